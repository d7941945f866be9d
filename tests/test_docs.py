"""The tables in docs/ that restate the code are generated from it (tools/doc_tables.py) and must be
current: every flag table row is the flag, default and help of a config field (or of an option a
command adds), every option of every stage is in exactly one table, and the serving-consumers table
is pipeline.drafter.serving_engines.CONSUMERS; the recipe bench's options table is its kept runs.
Also: every production module is in the code map."""

import importlib.util
import re
import shutil

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def doc_tables():
    spec = importlib.util.spec_from_file_location("doc_tables", REPO / "tools" / "doc_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current(doc_tables):
    stale = doc_tables.stale()
    assert stale == [], "\n".join(stale)


def test_every_option_of_every_stage_is_in_one_table(doc_tables):
    problems = doc_tables.coverage()
    assert problems == [], "\n".join(problems)


def test_the_consumers_table_is_generated(doc_tables):
    """(A stage with no flag table fails the test above.)"""
    from pipeline.drafter.serving_engines import CONSUMERS

    doc = (REPO / "docs" / "training.md").read_text()
    assert [m.group(1) for m, _ in doc_tables.tables(doc)].count("consumers") == 1
    assert all(f"| {doc_tables.cell(c.name)} |" in doc for c in CONSUMERS)


def test_every_training_option_of_the_bench_is_in_the_options_table(doc_tables):
    """The recipe bench's options on today's defaults (ON_DEFAULTS) each have a row of a generated table of
    paired figures (as RECIPE or RECIPE@LABEL: grad-bf16@p2 against default@p2, two processes), and a row of
    a recipe with no kept run says so."""
    from recipe_results import ON_DEFAULTS

    doc = (REPO / "docs" / "training.md").read_text()
    markers = [m for m, _ in doc_tables.tables(doc) if m.group(1) == "options"]
    assert markers
    options = {name.split("@")[0] for m in markers for name in m.group(2).split()[1:]}
    assert set(ON_DEFAULTS) <= options, f"add {set(ON_DEFAULTS) - options} to an <!-- options --> marker"
    listed = markers[0].group(2).split()
    assert "| default+lr-2e-3 | --lr 0.002 | not run |" in doc_tables.options_table([listed[0], "default+lr-2e-3"])
    with pytest.raises(ValueError, match="no recipe 'nonsense'"):
        doc_tables.options_table([listed[0], "nonsense"])
    with pytest.raises(ValueError, match="muon trained on .*: no paired figure"):  # kept from an older store
        doc_tables.options_table([listed[0], "muon"])


def test_an_option_cell_names_its_seeds_when_fewer_than_the_reference_has(doc_tables):
    ref = {"seeds": [0, 1, 2], "tau": {"mean": 8.8}}
    paired = {"seeds": [0, 1], "diff": -0.1, "relative": -0.0114, "ci95": [-0.5, 0.3]}
    assert doc_tables._option_cell(ref, "tau", ref) == "8.800 (3 seeds)"
    assert (
        doc_tables._option_cell({"tau": {"paired": paired}}, "tau", ref) == "-0.100 (-1.1%) [-0.500, +0.300]; 2 seeds"
    )
    full = {**paired, "seeds": [0, 1, 2]}
    assert doc_tables._option_cell({"tau": {"paired": full}}, "tau", ref) == "-0.100 (-1.1%) [-0.500, +0.300]"
    assert doc_tables._option_cell(None, "tau", ref) == "not run"
    assert doc_tables._option_cell({"seeds": [0], "tau_t1": {"mean": None}}, "tau_t1", ref) == "-"  # not measured


@pytest.fixture
def docs_copy(doc_tables, tmp_path):
    """docs/*.md copied and regenerated, so these tests see only their own edits."""
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("img"))
    for path in doc_tables.docs(tmp_path):
        path.write_text(doc_tables.render(path.read_text()))
    return tmp_path


def test_a_row_edited_by_hand_is_named(doc_tables, docs_copy):
    path = docs_copy / "docs" / "training.md"
    path.write_text(path.read_text().replace("| `--epochs INTEGER` | 6 |", "| `--epochs INTEGER` | 7 |"))
    assert doc_tables.stale(docs_copy) == [
        "docs/training.md: the table under <!-- flags: train run --> is out of date; run `python tools/doc_tables.py`"
    ]
    path.write_text(doc_tables.render(path.read_text()))
    assert doc_tables.stale(docs_copy) == []


def test_a_flag_missing_from_the_markers_or_unknown_is_named(doc_tables, docs_copy):
    path = docs_copy / "docs" / "training.md"
    text = path.read_text()
    marker = "<!-- flags: train shard_schedule -->"  # a component's flags (TrainConfig.shard_schedule), not a list
    assert text.count(marker) == 1
    path.write_text(text.replace(marker, "<!-- flags: train --follow --follow-poll -->"))
    assert doc_tables.coverage(docs_copy) == [
        "train: --shard-schedule in no table (add them to a <!-- flags: train ... --> marker, then run "
        "`python tools/doc_tables.py`)"
    ]
    path.write_text(text.replace(marker, "<!-- flags: train shard_schedule --no-such-flag -->"))
    assert doc_tables.coverage(docs_copy) == ["train: no option --no-such-flag (remove it from its marker)"]
    assert doc_tables.stale(docs_copy) == ["docs/training.md: train has no option --no-such-flag"]
    path.write_text(text.replace(marker, "<!-- flags: train shards -->"))
    named = "docs/training.md: train has no component 'shards' (one of data, shard_schedule, optim, loss, drafter, run)"
    assert doc_tables.coverage(docs_copy) == doc_tables.stale(docs_copy) == [named]


def test_the_train_tables_are_its_components(doc_tables):
    """Each train flag table is one component of TrainConfig, so a new setting lands in its table."""
    from stages.settings import parts
    from stages.train.config import TrainConfig

    doc = (REPO / "docs" / "training.md").read_text()
    markers = [m.group(2) for m, _ in doc_tables.tables(doc) if m.group(1) == "flags"]
    assert sorted(m for m in markers if m.startswith("train")) == sorted(f"train {p}" for p in parts(TrainConfig))


def mapped_files(doc: str) -> set[str]:
    """Every file the code map of doc names: `dir/a.py`, and a bare `b.py` after it in the same
    row as dir/b.py."""
    names = set()
    for line in doc.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([\w./]+\.py)`", line):
            if "/" in name:
                folder = name.rsplit("/", 1)[0]
            names.add(name if "/" in name or not folder else f"{folder}/{name}")
    return names


def test_every_production_module_is_in_the_code_map():
    from tests.test_layers import production_files

    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        p.relative_to(REPO).as_posix()
        for p in production_files(REPO)
        if p.name != "__init__.py" and p.relative_to(REPO).as_posix() not in mapped_files(doc)
    ]
    assert missing == [], f"docs/architecture.md's code map lacks {missing}"
