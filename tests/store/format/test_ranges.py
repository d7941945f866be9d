import pytest

from store.errors import ConfigError
from store.format.ranges import format_ranges, parse_ranges


def test_parse_ranges():
    assert parse_ranges("0-63") == list(range(64))
    assert parse_ranges("0-3,8,10-12") == [0, 1, 2, 3, 8, 10, 11, 12]
    assert parse_ranges("5, 1-2 ,2") == [1, 2, 5]


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2", "1-2-3", "0x3"])
def test_invalid_range_text(text):
    with pytest.raises(ConfigError, match="shard range"):
        parse_ranges(text)


def test_range_limit():
    assert parse_ranges("0-3", limit=4) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="reaches shard 4, but the store has 4 shards"):
        parse_ranges("0-4", limit=4)


def test_format_round_trip():
    ids = [0, 1, 2, 5, 7, 8, 20]
    assert format_ranges(ids) == "0-2,5,7-8,20"
    assert parse_ranges(format_ranges(ids)) == ids
    assert format_ranges([]) == ""


def test_all_is_every_shard_of_a_known_count():
    assert parse_ranges("all", limit=5) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="'all' needs a known shard count"):
        parse_ranges("all")
