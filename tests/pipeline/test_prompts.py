"""The prompt set: chat turns in either style, plain prompts, shard mapping, rows checked early."""

import json
from dataclasses import replace

import pytest

from pipeline import prompts
from pipeline.errors import DatasetError


def prompt_set(tmp_path, rows: list[dict]) -> prompts.PromptSet:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return prompts.load(str(path))


def test_sharegpt_rows_read_as_the_same_chat_as_messages(tmp_path):
    share = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Add 1+1"},
            {"from": "gpt", "value": "2"},
        ]
    }
    openai = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Add 1+1"},
            {"role": "assistant", "content": "2"},
        ]
    }
    a, b = prompt_set(tmp_path, [share]).row(0), prompt_set(tmp_path, [openai]).row(0)
    assert a == b
    assert a.response == "2" and [m["role"] for m in a.messages] == ["system", "user", "assistant", "user"]


def test_plain_prompts_and_rows_without_an_answer(tmp_path):
    ps = prompt_set(
        tmp_path, [{"prompt": "def f():", "response": "  pass"}, {"messages": [{"role": "user", "content": "q"}]}]
    )
    assert ps.row(0).messages == ({"role": "user", "content": "def f():"},) and ps.row(0).response == "  pass"
    assert ps.row(1).response is None


def test_roles_of_both_styles_come_from_one_table_case_ignored(tmp_path):
    """`User`/`Assistant` and ShareGPT's `human`/`gpt` name the same roles in either style, so the
    last assistant turn is the answer, not part of the prompt."""
    plain = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ]
    }
    variants = [
        {
            "messages": [
                {"role": "System", "content": "Be brief."},
                {"role": "User", "content": "Hi"},
                {"role": "Assistant", "content": "Hello"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "human", "content": "Hi"},
                {"role": "GPT", "content": "Hello"},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "Human", "value": "Hi"},
                {"from": "assistant", "value": "Hello"},
            ]
        },
    ]
    ps = prompt_set(tmp_path, [plain, *variants])
    want = ps.row(0)
    assert want.response == "Hello" and [m["role"] for m in want.messages] == ["system", "user"]
    for i in (1, 2, 3):
        assert ps.row(i).messages == want.messages and ps.row(i).answer == want.answer


def test_text_content_parts_are_joined_with_no_separator(tmp_path):
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "def f(x):"}, {"type": "text", "text": " return"}]},
            {"role": "assistant", "content": [{"type": "text", "text": " x + 1"}]},
        ]
    }
    text = {"messages": [{"role": "user", "content": "def f(x): return"}, {"role": "assistant", "content": " x + 1"}]}
    plain = {
        "prompt": "def f(x): return",
        "response": [{"type": "text", "text": " x"}, {"type": "text", "text": " + 1"}],
    }
    ps = prompt_set(tmp_path, [parts, text, plain])
    assert ps.row(0) == replace(ps.row(1), index=0)
    assert ps.row(2).response == " x + 1" and ps.row(2).messages == ps.row(1).messages


def test_a_blank_answer_is_no_response(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}
        for answer in ("", "  \n ", None, [], "a")
    ]
    rows += [
        {"prompt": "q", "response": " "},
        {"prompt_ids": [1, 2], "response_ids": []},
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
                },
            ]
        },
    ]
    ps = prompt_set(tmp_path, rows)
    assert [prompts.has_response(ps.row(i)) for i in range(len(rows))] == [False] * 4 + [True, False, False, True]


@pytest.mark.parametrize(
    "row,needle",
    [
        ({"conversations": [{"from": "bot", "value": "x"}]}, "row 1 field 'conversations' turn 0: 'from' is 'bot'"),
        ({"conversations": [{"speaker": "human", "text": "x"}]}, "row 1 field 'conversations' turn 0: expected"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
            "row 1 field 'messages' turn 1: 'role' is 'bot', expected one of system, user, assistant, tool, human, gpt",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Describe"},
                            {"type": "image_url", "image_url": {"url": "x"}},
                        ],
                    }
                ]
            },
            "row 1 field 'messages' turn 0: content part 1 is of type 'image_url'; only text parts",
        ),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "row 1 field 'messages' turn 0: content is dict"),
        ({"messages": "hello"}, "row 1 field 'messages' is not a list of turns"),
        ({"prompt": 5}, "row 1 field 'prompt' is int, expected text"),
        ({"question": "x"}, "row 1 has neither field 'messages' ('conversations') nor 'prompt'"),
    ],
)
def test_a_bad_row_is_named_by_the_early_check(tmp_path, row, needle):
    ps = prompt_set(tmp_path, [{"prompt": "fine"}, row, {"prompt": "fine"}])
    with pytest.raises(DatasetError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ps.check(range(3))
    ps.check([0, 2])  # the other rows are fine


def test_rows_map_to_shards_by_position(tmp_path):
    ps = prompt_set(tmp_path, [{"prompt": str(i)} for i in range(10)])
    parts = [list(ps.shard_rows(s, 4)) for s in range(4)]
    assert sum(parts, []) == list(range(10)) and [len(p) for p in parts] == [2, 3, 2, 3]


def test_extract_reports_a_bad_row_in_the_last_shard_before_loading_the_target(tmp_path, small_dataset):
    """The bad row sits in shard 3 of 0-3, and the named target does not even exist: the row is
    reported first, so nothing was loaded or written."""
    from tests.processes import cli_args, run_pipeline

    rows = [json.loads(x) for x in small_dataset.read_text().splitlines()]
    rows[-1] = {"conversations": [{"from": "robot", "value": "x"}]}
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = run_pipeline(cli_args(tmp_path / "hs.zarr", data, "0-3") + ["--target", str(tmp_path / "no-such-target")])
    assert p.returncode == 2, p.stderr
    assert f"row {len(rows) - 1} field 'conversations' turn 0: 'from' is 'robot'" in p.stderr.splitlines()[-1]
    assert not (tmp_path / "hs.zarr").exists()


def _one_group_parquet(path, n):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = __import__("random").Random(0)
    prompts = ["w" * rng.randrange(1, 300) for _ in range(n)]  # lengths in no order
    pq.write_table(pa.table({"prompt": prompts, "response": ["r"] * n}), path, row_group_size=n)  # one row group
    return prompts


def test_a_shard_of_a_parquet_file_is_read_in_one_forward_pass(tmp_path, monkeypatch):
    """Rows decoded for three consecutive shards of a one-row-group file ~ the rows up to their end
    (taken in length order, every step back restarted the group: thousands of times that)."""
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    texts = _one_group_parquet(path, 20_000)
    decoded = []
    real = pq.ParquetFile.iter_batches

    def counting(self, *a, **k):
        for batch in real(self, *a, **k):
            decoded.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    ps = prompts.load(str(path))
    got = [ps.by_length(ps.shard_rows(s, 20)) for s in (3, 4, 5)]
    assert sum(decoded) <= 6_000 + 256  # the stream runs once up to shard 5's end, one batch of slack
    for s, rows in zip((3, 4, 5), got):
        ids = list(ps.shard_rows(s, 20))
        assert [r.index for r in rows] == sorted(ids, key=lambda i: len(texts[i]))  # length order, stable
        assert all(r.messages[0]["content"] == texts[r.index] for r in rows)
