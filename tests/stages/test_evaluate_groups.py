"""tau per category (extraction's --category-field) and per context-length bucket: each group's tau
is the report's own per-prompt figures averaged over exactly that group."""

import json

import pytest

from pipeline.decode.acceptance import CONTEXT_LABELS, ci95, context_bucket
from pipeline.decode.batch_replay import PromptCounts
from stages.evaluate import groups
from stages.evaluate.config import EvalConfig
from stages.evaluate.report import console
from stages.evaluate.run import run
from stages.extract.config import ExtractConfig
from stages.extract.run import run as extract
from store.hidden_store import HiddenStore
from tests.conftest import SMALL, small_rows


@pytest.fixture(scope="module")
def labelled_store(tmp_path_factory):
    """Shard 3 of the small store's prompts, each row labelled by the parity of its index."""
    tmp = tmp_path_factory.mktemp("labelled")
    rows = [{**r, "source": "even" if i % 2 == 0 else "odd"} for i, r in enumerate(small_rows())]
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract(
        ExtractConfig(
            store=str(tmp / "hs.zarr"), dataset=str(data), shards="3", num_shards=4, category_field="source", **SMALL
        ),
        log=lambda m: None,
    )
    return tmp / "hs.zarr"


def test_every_sample_keeps_its_rows_label(labelled_store):
    from store.shard_reader import ShardReader

    store = HiddenStore(str(labelled_store))
    record, reader = store.commit_record(3), ShardReader(store, 3)
    assert len(record.categories["codes"]) == record.samples == len(reader)
    assert [record.category(i) for i in range(len(reader))] == ["even" if r % 2 == 0 else "odd" for r in reader.row_ids]
    assert store.attrs.compat.dataset_fields["category"] == "source"


def test_tau_per_category_and_context_is_the_mean_over_exactly_those_prompts(labelled_store, trained_drafter, tmp_path):
    """The drafter was trained on the small store: another store of the same conditioning (its data
    differs: labels added) is replayed without --allow-mismatch, and the report says so."""
    rep = run(
        EvalConfig(
            store=str(labelled_store),
            checkpoints=(str(trained_drafter),),
            shards="3",
            ddtree=(1, 8),
            out=str(tmp_path / "rep"),
        ),
        log=lambda m: None,
    )
    r = rep["checkpoints"][0]
    assert r["check"].startswith("conditioning matches") and rep["warnings"] == []
    assert set(r["per_category"]) == {"even", "odd"}
    for label, g in r["per_category"].items():
        mine = [p for p in r["per_prompt"] if ("even" if p["row_id"] % 2 == 0 else "odd") == label]
        assert g["prompts"] == g["available"] == len(mine)  # all replayed: the interval is still over the prompts
        assert g["tau_ci95"] == pytest.approx(ci95([p["tau"] for p in mine], g["tau"]))
        assert g["tau_ci95"][0] < g["tau_ci95"][1]
        assert g["tau"] == pytest.approx(sum(p["tau"] for p in mine) / len(mine))
        for b in ("1", "8"):
            assert g["ddtree"][b] == pytest.approx(sum(p["ddtree"][b] for p in mine) / len(mine))
    assert list(r["per_context"]) == ["<1k"]  # the small store's samples are short: every round is in it
    short = r["per_context"]["<1k"]
    assert short["tau"] == pytest.approx(r["tau"]) and short["rounds"] == r["rounds"]
    assert short["ddtree"]["8"] == pytest.approx(r["ddtree"]["8"]) and short["tau_ci95"] is not None
    text = console(rep)
    assert "tau by category:" in text and "tau by context:" in text and "even" in text
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "tau by category:" in md and "| " + r["name"] + " | odd | " in md


def test_a_store_without_labels_reports_no_categories(small_store, trained_drafter, tmp_path):
    rep = run(
        EvalConfig(
            store=str(small_store),
            checkpoints=(str(trained_drafter),),
            ddtree=(8,),
            max_prompts=4,
            out=str(tmp_path / "rep"),
        ),
        log=lambda m: None,
    )
    assert rep["checkpoints"][0]["per_category"] == {} and "tau by category" not in console(rep)


def test_context_buckets_by_the_rounds_context():
    assert [context_bucket(s) for s in (0, 1022, 1023, 4094, 4095, 16382, 16383, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(CONTEXT_LABELS) == 4

    def prompt(rounds, tokens):  # one policy; rounds and tokens per bucket
        return PromptCounts(0, 0, 0, 10, 10, [sum(rounds)], [sum(tokens)], None, [rounds], [tokens])

    a, b = prompt([2, 1, 0, 0], [6, 1, 0, 0]), prompt([1, 0, 0, 0], [5, 0, 0, 0])
    got = groups.by_context([a, b], ())
    assert list(got) == ["<1k", "1k-4k"]
    assert got["<1k"]["tau"] == pytest.approx((3 + 5) / 2) and got["<1k"]["prompts"] == 2
    assert got["1k-4k"]["tau"] == 1 and got["1k-4k"]["prompts"] == 1 and got["1k-4k"]["tau_ci95"] is None
