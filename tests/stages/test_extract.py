import dataclasses
import json

import pytest
import torch

from stages.extract.config import ExtractConfig
from stages.extract.run import run
from store.errors import StoreCorrupt, StoreMismatch
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests.conftest import SMALL, damage_states, small_rows
from tests.targets import bf16_close, chat_prompt, reference_states


def samples(path):
    store = HiddenStore(str(path))
    for shard in store.committed():
        yield from ShardReader(store, shard)


def test_every_row_lands_in_its_shard_or_is_counted(small_store):
    store = HiddenStore(str(small_store))
    committed = store.committed()
    assert list(committed) == [0, 1, 2, 3]
    rows = small_rows()
    n = len(rows)
    seen = []
    for shard in committed:
        got = ShardReader(store, shard).row_ids.tolist()
        assert set(got) <= set(range(shard * n // 4, (shard + 1) * n // 4))
        seen += got
    skipped = {k: sum(m.skipped[k] for m in committed.values()) for k in ("empty_prompt", "prompt_too_long")}
    assert skipped == {"empty_prompt": 1, "prompt_too_long": 1}
    assert sorted(seen) == [i for i in range(n) if i not in (3, 7)]


def test_loss_mask_is_exactly_the_completion(small_store, target):
    tok = target.tokenizer
    rows = small_rows()
    for s in samples(small_store):
        prompt = chat_prompt(tok, rows[s.row_id]["messages"][:1])
        assert s.tokens[: s.prompt_len].tolist() == prompt
        assert not s.loss_mask[: s.prompt_len].any() and s.loss_mask[s.prompt_len :].all()
        assert len(s.tokens) > s.prompt_len


def test_stored_completions_are_the_targets_greedy_generate(small_store, target):
    for s in samples(small_store):
        prompt = s.tokens[: s.prompt_len]
        limit = min(SMALL["max_new_tokens"], SMALL["max_length"] - s.prompt_len)
        with torch.inference_mode():
            out = target.model.generate(prompt[None], max_new_tokens=limit, do_sample=False)[0, s.prompt_len :].tolist()
        stored = s.tokens[s.prompt_len :].tolist()
        eos = target.eos_ids[0]
        expected = out[: out.index(eos) + 1] if eos in out else out
        assert stored == expected, s.row_id


def test_stored_taps_are_the_unbatched_layer_outputs(small_store, target):
    taps = HiddenStore(str(small_store)).attrs.taps
    assert taps == (1, 2, 3, 4, 5)  # DFlash formula for 8 layers
    for s in samples(small_store):
        hs = reference_states(target, s.tokens.tolist())
        for j, k in enumerate(taps):
            assert bf16_close(s.hidden[:, j], hs[k + 1][0]), (s.row_id, k)
            assert not bf16_close(s.hidden[:, j], hs[k][0]), (s.row_id, k)


def test_root_records_provenance_and_frozen_weights(small_store, target):
    store = HiddenStore(str(small_store))
    a = store.attrs
    assert a.backends.linear_attention == "torch" and a.device == "cpu" and a.dtype == "fp32"
    assert a.target.model_class.endswith("Qwen3_5ForCausalLM")
    assert a.mask_token_id == target.tokenizer.mask_token_id
    assert a.hidden_size == 128 and a.vocab_size == 4096 and a.num_layers == 8
    assert a.compat.max_new_tokens == a.extract["max_new_tokens"] == SMALL["max_new_tokens"]
    embed = target.model.get_input_embeddings().weight.to(torch.bfloat16)
    head = target.model.get_output_embeddings().weight.to(torch.bfloat16)
    assert torch.equal(store.embedding("embed_tokens"), embed)
    assert torch.equal(store.embedding("lm_head"), head)


def test_agreement_is_recorded_per_shard(small_store, tmp_path, small_dataset):
    """Regenerated references are the target's own argmax (fp32: all of them); the dataset's human
    responses are not, and the check says so."""
    from store.summary import summarize

    s = summarize(HiddenStore(str(small_store)))["agreement"]
    assert s["shards_checked"] == 4 and s["tokens"] > 50 and s["rate"] == 1.0
    config = ExtractConfig(
        store=str(tmp_path / "ds.zarr"),
        dataset=str(small_dataset),
        shards="0",
        num_shards=4,
        responses="dataset",
        **SMALL,
    )
    assert run(config, log=lambda m: None)["agreement"]["rate"] < 0.9


def test_rerun_skips_committed_shards(small_store, small_dataset):
    before = HiddenStore(str(small_store)).committed()
    config = ExtractConfig(store=str(small_store), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL)
    summary = run(config, log=lambda m: None)
    assert summary["shards_written"] == [] and summary["shards_skipped"] == [0, 1, 2, 3]
    assert HiddenStore(str(small_store)).committed() == before


def test_an_fp8_store_holds_the_bf16_states_rounded_and_is_checked_alike(small_store, fp8_store):
    """The same samples as the bf16 store, each state the bf16 one rounded by fp8_codec.quantize; its
    own conditioning, which differs from the bf16 store's in the hidden format only; chunk checksums,
    direct reads and verify as in the bf16 layout."""
    from store.format import fp8_codec
    from store.summary import render, summarize
    from store.verify import verify

    bf16, fp8 = HiddenStore(str(small_store)), HiddenStore(str(fp8_store))
    assert (fp8.attrs.compat.hidden_format, fp8.attrs.compat.codec) == ("fp8", "fp8")
    assert fp8.attrs.compat.differences(bf16.attrs.compat) == {
        "codec": ("fp8", "planes"),
        "hidden_format": ("fp8", None),
    }
    assert fp8.attrs.compat.conditioning() != bf16.attrs.compat.conditioning()
    assert fp8.attrs.compat.as_format("bf16").conditioning() == bf16.attrs.compat.conditioning()
    assert fp8.attrs.layout.compressor[0] == {"name": "dflash.fp8_e4m3", "configuration": {"group": 128, "level": 1}}
    checks = fp8.read_checks(fp8.committed())
    assert checks.chunk_checksums and checks.direct_reads and checks.warning() is None
    assert "fp8 states, codec fp8" in render(summarize(fp8))
    for a, b in zip(samples(small_store), samples(fp8_store), strict=True):
        assert a.row_id == b.row_id and torch.equal(a.tokens, b.tokens)
        assert torch.equal(b.hidden, fp8_codec.quantize(a.hidden)) and not torch.equal(b.hidden, a.hidden)
    assert verify(fp8).ok


def test_a_store_keeps_the_hidden_format_it_was_made_with(fp8_store, tmp_path, small_dataset):
    import shutil

    shutil.copytree(fp8_store, tmp_path / "s.zarr")
    bf16 = ExtractConfig(
        store=str(tmp_path / "s.zarr"), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL
    )
    refused = 'hidden_format: store has "fp8", this run has null.*pass --hidden-format fp8'
    with pytest.raises(StoreMismatch, match=refused):
        run(bf16, log=lambda m: None)
    assert run(dataclasses.replace(bf16, hidden_format="fp8"), log=lambda m: None)["shards_skipped"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "damage,hidden_format", [("states", "bf16"), ("commit file", "bf16"), ("array metadata", "bf16"), ("states", "fp8")]
)
def test_redo_extracts_a_corrupt_shard_again_bit_for_bit(request, tmp_path, small_dataset, damage, hidden_format):
    import shutil

    small_store = request.getfixturevalue("fp8_store" if hidden_format == "fp8" else "small_store")
    store_copy = tmp_path / "copy.zarr"
    shutil.copytree(small_store, store_copy)
    if damage == "states":
        damage_states(store_copy, 1)
    else:
        path, old, new = (
            (store_copy / "_commits/00001.json", '"samples": ', '"samples": 1')
            if damage == "commit file"
            else (store_copy / "shards/00001/offsets/zarr.json", "int64", "int32")
        )
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new, 1))  # still JSON
    untouched = (store_copy / "_commits/00002.json").stat().st_mtime_ns
    config = ExtractConfig(
        store=str(store_copy),
        dataset=str(small_dataset),
        shards="0-3",
        num_shards=4,
        redo=True,
        hidden_format=hidden_format,
        **SMALL,
    )
    if damage == "commit file":  # without --redo: one line naming the file and the fix
        with pytest.raises(StoreCorrupt, match=r"_commits/00001.json: damaged commit file .*--shards 1 --redo"):
            run(dataclasses.replace(config, redo=False), log=lambda m: None)
    lines = []
    summary = run(config, log=lines.append)
    assert summary["shards_written"] == [1] and summary["shards_skipped"] == [0, 2, 3]
    assert any(line.startswith("shard 1 is corrupt (") for line in lines)
    assert (store_copy / "_commits/00002.json").stat().st_mtime_ns == untouched
    for f in (p for p in (small_store / "shards/00001").rglob("*") if p.is_file()):
        assert f.read_bytes() == (store_copy / f.relative_to(small_store)).read_bytes(), f
    again = run(config, log=lambda m: None)  # nothing corrupt left: nothing redone
    assert again["shards_written"] == [] and again["shards_skipped"] == [0, 1, 2, 3]


def test_dataset_responses_are_stored_verbatim(tmp_path, small_dataset, target):
    config = ExtractConfig(
        store=str(tmp_path / "ds.zarr"),
        dataset=str(small_dataset),
        shards="0",
        num_shards=4,
        responses="dataset",
        **{**SMALL, "max_new_tokens": 400, "max_length": 600},
    )
    run(config, log=lambda m: None)
    rows = small_rows()
    tok = target.tokenizer
    got = list(samples(tmp_path / "ds.zarr"))
    assert got
    for s in got:
        response = rows[s.row_id]["messages"][1]["content"]
        assert s.tokens[s.prompt_len :].tolist() == tok(response, add_special_tokens=False).input_ids + [
            target.eos_ids[0]
        ]


def test_plain_prompt_rows_and_missing_responses(tmp_path, target):
    data = tmp_path / "p.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": 'def add(a, b):\n    """Add."""', "response": "    return a + b"},
                {"prompt": "def sub(a, b):"},
            ]
        )
    )
    config = ExtractConfig(
        store=str(tmp_path / "p.zarr"), dataset=str(data), shards="0", num_shards=1, responses="dataset", **SMALL
    )
    summary = run(config, log=lambda m: None)
    assert summary["samples"] == 1 and summary["skipped"]["missing_response"] == 1


def test_response_ids_from_an_engine_are_stored_verbatim(tmp_path, target):
    from pipeline.errors import DatasetError

    data = tmp_path / "ids.jsonl"
    rows = [
        {"prompt": "def add(a, b):", "response_ids": [17, 300, 42, 9, 2]},
        {"messages": [{"role": "user", "content": "def sub(a, b):"}], "response_ids": [5, 6, 7]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = ExtractConfig(
        store=str(tmp_path / "ids.zarr"), dataset=str(data), shards="0", num_shards=1, responses="dataset", **SMALL
    )
    run(config, log=lambda m: None)
    got = {s.row_id: s.tokens[s.prompt_len :].tolist() for s in samples(tmp_path / "ids.zarr")}
    assert got == {0: [17, 300, 42, 9, 2], 1: [5, 6, 7]}
    data.write_text(json.dumps({"prompt": "x", "response_ids": [1, 99999]}) + "\n")
    with pytest.raises(DatasetError, match="row 0 response ids hold 99999, outside the target's vocabulary"):
        run(
            ExtractConfig(
                store=str(tmp_path / "bad.zarr"),
                dataset=str(data),
                shards="0",
                num_shards=1,
                responses="dataset",
                **SMALL,
            ),
            log=lambda m: None,
        )


def test_token_rows_are_stored_exactly_as_given(tmp_path, target):
    """An agent's rollout recorded as ids: input_ids with its loss mask (the last run of 1s is the
    answer, earlier runs keep the loss inside the prompt), or prompt_ids with response_ids; no
    template, the target's agreement counted on the answers."""
    from pipeline.errors import DatasetError

    tok = target.tokenizer
    chat = tok(
        "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    ).input_ids
    answer = tok("    return a + b<|im_end|>", add_special_tokens=False).input_ids
    tool = tok("\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    ids = chat + answer + tool + answer + [7, 8]  # two answers, then tokens after the last one
    mask = [0] * len(chat) + [1] * len(answer) + [0] * len(tool) + [1] * len(answer) + [0, 0]
    rows = [{"input_ids": ids, "loss_mask": mask}, {"prompt_ids": chat, "response_ids": answer}]
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run(
        ExtractConfig(
            store=str(tmp_path / "t.zarr"),
            dataset=str(data),
            shards="0",
            num_shards=1,
            responses="dataset",
            **{**SMALL, "max_length": 400},
        ),
        log=lambda m: None,
    )
    got = {s.row_id: s for s in samples(tmp_path / "t.zarr")}
    assert got[0].tokens.tolist() == ids[:-2] and got[0].loss_mask.tolist() == mask[:-2]
    assert got[0].prompt_len == len(chat) + len(answer) + len(tool)
    assert got[1].tokens.tolist() == chat + answer and got[1].prompt_len == len(chat)
    assert got[1].loss_mask.tolist() == [0] * len(chat) + [1] * len(answer)
    assert summary["template_modes"] == {"token ids (no template)": 2} and summary["agreement"]["tokens"] == 2 * len(
        answer
    )
    for bad, problem in [
        ({"prompt_ids": [1, 99999], "response_ids": [5]}, "row 0 prompt ids hold 99999, outside"),
        (
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1]},
            "row 0 field 'loss_mask' must be a list of 0 and 1 as long as 'input_ids' \\(3 ids\\)",
        ),
    ]:
        data.write_text(json.dumps(bad) + "\n")
        with pytest.raises(DatasetError, match=problem):
            run(
                ExtractConfig(
                    store=str(tmp_path / "bad.zarr"),
                    dataset=str(data),
                    shards="0",
                    num_shards=1,
                    responses="dataset",
                    **SMALL,
                ),
                log=lambda m: None,
            )


def multi_turn_rows() -> list[dict]:
    """Conversations of two to three exchanges built from the shipped prompts, answers included."""
    rows = []
    base = [r for r in small_rows() if len(r["messages"]) == 2 and r["messages"][1]["content"].strip()][:9]
    for k in range(0, len(base) - 2, 3):
        a, b, c = base[k : k + 3]
        chat = [{"role": "system", "content": "You write Python."}] + a["messages"] + b["messages"]
        rows.append({"messages": chat + (c["messages"] if k == 3 else [])})
    return rows


def test_every_assistant_turn_carries_the_loss_with_turns_all(tmp_path, target):
    """--turns all stores the same tokens and states as --turns last; only the loss mask grows, by
    exactly the tokens of the earlier answers (each with its end-of-turn token)."""
    from store.errors import StoreMismatch
    from store.verify import verify

    data = tmp_path / "chats.jsonl"
    rows = multi_turn_rows()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = dict(
        dataset=str(data),
        shards="0",
        num_shards=1,
        responses="dataset",
        **{**SMALL, "max_new_tokens": 400, "max_length": 1500},
    )
    run(ExtractConfig(store=str(tmp_path / "all.zarr"), turns="all", **common), log=lambda m: None)
    run(ExtractConfig(store=str(tmp_path / "last.zarr"), **common), log=lambda m: None)
    every, last = list(samples(tmp_path / "all.zarr")), list(samples(tmp_path / "last.zarr"))
    assert len(every) == len(rows) == 3
    tok = target.tokenizer
    for a, b in zip(every, last):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden, b.hidden) and a.prompt_len == b.prompt_len
        assert (
            torch.equal(a.loss_mask[a.prompt_len :], b.loss_mask[b.prompt_len :])
            and not b.loss_mask[: b.prompt_len].any()
        )
        earlier = [m["content"] + "<|im_end|>" for m in rows[a.row_id]["messages"][:-1] if m["role"] == "assistant"]
        extra = (a.loss_mask & ~b.loss_mask).nonzero().flatten().tolist()
        runs = [[extra[0]]] if extra else []
        for k in extra[1:]:
            runs[-1].append(k) if k == runs[-1][-1] + 1 else runs.append([k])
        decoded = [tok.decode(a.tokens[r[0] : r[-1] + 1]) for r in runs]
        assert len(decoded) == len(earlier) > 0
        for d, e in zip(decoded, earlier):  # a token may hold the header's newline and the answer's indent
            assert d.endswith(e) and d[: -len(e)] in ("", "\n"), (d, e)
    store = HiddenStore(str(tmp_path / "all.zarr"))
    assert store.attrs.compat.turns == "all" and HiddenStore(str(tmp_path / "last.zarr")).attrs.compat.turns is None
    assert verify(store).ok and verify(HiddenStore(str(tmp_path / "last.zarr"))).ok
    with pytest.raises(StoreMismatch, match="turns"):
        run(ExtractConfig(store=str(tmp_path / "all.zarr"), **common), log=lambda m: None)


def test_a_new_store_gets_a_small_shard_per_thousand_rows(tmp_path):
    """The shard is the unit of retry: a big dataset gets many shards, a small one still 64; an
    existing store keeps its own count whatever the dataset size."""
    from stages.extract.run import resolve_shards

    fresh = HiddenStore(str(tmp_path / "new.zarr"))
    assert resolve_shards(ExtractConfig(store=fresh.location), fresh, 2_500_000) == (list(range(2442)), 2442)
    assert resolve_shards(ExtractConfig(store=fresh.location, shards="0-3"), fresh, 640) == ([0, 1, 2, 3], 64)
    assert resolve_shards(ExtractConfig(store=fresh.location, num_shards=8), fresh, 2_500_000)[1] == 8


def test_an_existing_store_keeps_its_shard_count(small_store):
    from stages.extract.run import resolve_shards

    store = HiddenStore(str(small_store))
    assert resolve_shards(ExtractConfig(store=str(small_store)), store, 2_500_000) == ([0, 1, 2, 3], 4)


@pytest.mark.parametrize("damage", ["zarr.json", "target/lm_head/c.0.0", "_commits/root.json"])
def test_redo_rebuilds_a_damaged_root_made_with_the_same_settings(small_store, store_copy, small_dataset, damage):
    from tests.store.test_damage import damaged, equal, read_everything

    clean = read_everything(str(small_store), [0, 1, 2, 3])
    path = store_copy / damage
    path.write_bytes(damaged(path.read_bytes(), "digit" if damage == "zarr.json" else "flip"))
    config = ExtractConfig(store=str(store_copy), dataset=str(small_dataset), shards="0-3", num_shards=4, **SMALL)
    with pytest.raises(StoreCorrupt, match=f"{damage.split('/c.')[0]}.*the store's root is damaged.*--redo"):
        read_everything(str(store_copy), [0, 1, 2, 3])  # what training and evaluation read
    other = dataclasses.replace(config, redo=True, max_new_tokens=SMALL["max_new_tokens"] + 1)
    with pytest.raises(StoreMismatch, match="cannot be rebuilt from this run: the store was made with other settings"):
        run(other, log=lambda m: None)
    lines = []
    summary = run(dataclasses.replace(config, redo=True), log=lines.append)
    assert any(": rebuilt;" in line for line in lines) and summary["shards_written"] == []
    got = read_everything(str(store_copy), [0, 1, 2, 3])
    assert got["attrs"].compat == clean["attrs"].compat and got["attrs"].fingerprint == clean["attrs"].fingerprint
    assert equal({k: v for k, v in got.items() if k != "attrs"}, {k: v for k, v in clean.items() if k != "attrs"})


def test_a_run_that_stores_no_sample_fails_naming_why_and_keeps_its_shards(tmp_path, small_dataset):
    """Every row skipped (all but the empty one over --max-length): the run fails with the skip
    counts and the fix, its shards committed (empty); a rerun that finds them committed passes."""
    from pipeline.errors import DatasetError

    config = ExtractConfig(
        store=str(tmp_path / "hs.zarr"),
        dataset=str(small_dataset),
        num_shards=4,
        shards="0-1",
        **{**SMALL, "max_length": 8},
    )
    with pytest.raises(DatasetError) as e:
        run(config, log=lambda m: None)
    assert str(e.value).startswith(
        f"{config.store}: 0 samples stored in shard(s) 0-1 (dataset {small_dataset}): "
        "of their 8 rows, 7 with a prompt of --max-length 8 tokens or more, 1 with an "
        "empty prompt. Fix: raise --max-length"
    )
    committed = HiddenStore(config.store).committed()
    assert list(committed) == [0, 1] and not any(r.samples for r in committed.values())
    again = run(config, log=lambda m: None)  # nothing written: not judged
    assert again["shards_skipped"] == [0, 1] and again["shards_written"] == []


def test_a_run_judges_all_its_shards_not_each(tmp_path, small_dataset):
    """Empty shards beside shards that hold samples pass; so does a process of a launcher that
    ends while another's shard of --shards is uncommitted; shards without rows are named."""
    from pipeline.errors import DatasetError
    from stages.extract.run import check_stored

    path = str(tmp_path / "hs.zarr")
    config = ExtractConfig(store=path, dataset=str(small_dataset), num_shards=32, shards="0-5", **SMALL)
    summary = run(config, log=lambda m: None)  # 16 rows over 32 shards: 1, 3 and 5 hold one each, 0, 2 and 4 none
    assert summary["samples"] == 3 and [HiddenStore(path).commit_record(s).samples for s in (0, 2, 4)] == [0, 0, 0]
    with pytest.raises(
        DatasetError,
        match=r"0 samples stored in shard\(s\) 6 .*: they hold none of its 16 rows; "
        "choose --shards that hold rows",
    ):
        run(dataclasses.replace(config, shards="6"), log=lambda m: None)
    early = {"shards_written": [6], "samples": 0}  # shard 6 written empty, shard 8 still at another process
    check_stored(dataclasses.replace(config, shards="6,8"), HiddenStore(path), early, [6, 8], None, 32)


def test_a_dataset_without_rows_fails_before_the_target_loads(tmp_path):
    from pipeline.errors import DatasetError

    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl: no rows"):
        run(
            ExtractConfig(store=str(tmp_path / "hs.zarr"), dataset=str(data), target="/nonexistent", **SMALL),
            log=lambda m: None,
        )
    assert not (tmp_path / "hs.zarr").exists()


def test_progress_reaches_the_log_inside_a_shard(tmp_path, small_dataset, monkeypatch):
    """Without a terminal, a line every LINE_EVERY_S (0 here: every report): the batch being
    generated token by token, then the rows and tokens done, all before the shard commits."""
    from stages.extract import progress

    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    lines = []
    run(
        ExtractConfig(store=str(tmp_path / "hs.zarr"), dataset=str(small_dataset), num_shards=4, shards="0", **SMALL),
        log=lines.append,
    )
    commit = next(i for i, m in enumerate(lines) if m.startswith("shard 0: "))
    inside = [m for m in lines[:commit] if m.startswith("progress: ")]
    assert inside[0].startswith("progress: 0/4 rows, 0 tokens") and "shard 0: generating token 1/" in inside[0]
    batch = next(m for m in inside if m.startswith("progress: 3/4 rows, "))  # the first batch of 3, written
    assert int(batch.split(", ")[1].split()[0]) > 0 and "generating" not in batch  # its tokens


def test_the_capture_budget_changes_neither_the_store_nor_its_conditioning(small_store, tmp_path, small_dataset):
    """--capture-tokens 64 (rows of the small set run 20-160 tokens: many forwards, the longest rows
    chunked through the cache) writes the fixture's samples, states within one bf16 step in a few
    values, under the same fingerprint; the budget is recorded in each shard's run record."""
    path = tmp_path / "budget.zarr"
    config = ExtractConfig(
        store=str(path), dataset=str(small_dataset), shards="0-1", num_shards=4, **{**SMALL, "capture_tokens": 64}
    )
    run(config, log=lambda m: None)
    new, old = HiddenStore(str(path)), HiddenStore(str(small_store))
    assert new.attrs.fingerprint == old.attrs.fingerprint
    assert new.commit_record(0).run["capture_tokens"] == 64
    mine = {s.row_id: s for s in samples(path)}
    theirs = [s for s in samples(small_store) if s.row_id in mine]
    assert len(mine) == len(theirs) > 0
    for s in theirs:
        got = mine[s.row_id]
        assert torch.equal(got.tokens, s.tokens) and bf16_close(got.hidden, s.hidden.float()), s.row_id
        assert (got.hidden != s.hidden).float().mean() <= 1e-3, s.row_id


@pytest.mark.parametrize("bad", [0, -64])
def test_a_capture_budget_below_one_token_is_refused_naming_the_flag(bad):
    from store.errors import ConfigError

    with pytest.raises(ConfigError, match="--capture-tokens"):
        ExtractConfig(capture_tokens=bad, device="cpu")
