import pytest

from pipeline.target.taps import default_taps, parse_taps
from store.errors import ConfigError


def test_dflash_formula_matches_spec():
    assert default_taps(64) == [1, 16, 31, 46, 61]
    assert default_taps(36) == [1, 9, 17, 25, 33]
    assert default_taps(8) == [1, 2, 3, 4, 5]
    assert default_taps(64, 1) == [32]
    assert default_taps(36, 3) == [1, 17, 33]


def test_parse_taps():
    assert parse_taps(None, 36) == [1, 9, 17, 25, 33]
    assert parse_taps("n=3", 36) == [1, 17, 33]
    assert parse_taps("0,7", 8) == [0, 7]


@pytest.mark.parametrize(
    "text,match",
    [
        ("8", r"out of range: the target has 8 decoder layers \(ids 0-7\)"),
        ("1,9", r"\[9\] out of range"),
        ("-1", "out of range"),
        ("3,1", "strictly increasing"),
        ("1,1", "strictly increasing"),
        ("a,b", "comma-separated"),
        ("n=x", "n=<count>"),
        ("n=0", "at least one tap"),
    ],
)
def test_bad_taps(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_taps(text, 8)
