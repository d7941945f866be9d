"""What an output directory holds, and what a command may replace there (the commands' own tests run them)."""

from stages.out_contents import REPORT, RUN, Output, described, enclosing_store, entries
from store.errors import ConfigError

EXPORT = Output(
    command="export",
    flag="OUT_DIR",
    files=("config.json", "model.safetensors", "README.md"),
    earlier="an earlier export",
    writes="export writes here",
    whole=True,
)
REPORTS = Output(
    command="evaluate.py",
    flag="--out",
    files=("report.json", "report.md"),
    earlier="a report",
    writes="evaluate.py writes here",
    scratch=REPORT,
)


def make(directory, *names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith("/"):
            (directory / name).mkdir()
        else:
            (directory / name).write_text("x")
    return directory


def refusal(output: Output, directory, force: bool) -> str | None:
    try:
        output.check(directory, force)
    except ConfigError as e:
        return e.problem
    return None


def test_a_directory_is_named_by_the_kind_its_entries_show(tmp_path):
    run = make(tmp_path / "run", "step-20/", "final/", "metrics.jsonl", ".step-40.tmp/", "notes.txt")
    assert entries(run) == [".step-40.tmp/", "final/", "metrics.jsonl", "notes.txt", "step-20/"]
    assert RUN.marked(entries(run)) == ["metrics.jsonl", "final/", ".step-40.tmp/", "step-20/"]
    assert described(entries(run), "x") == "is a training run (metrics.jsonl, final/, .step-40.tmp/, ...)"
    assert described(["a.txt"], "export") == "holds files export did not write (a.txt)"
    assert entries(tmp_path / "absent") == [] and entries(make(tmp_path, "file") / "file") == []


def test_only_the_commands_own_earlier_output_is_replaced_and_only_with_force(tmp_path):
    assert refusal(EXPORT, tmp_path / "absent", False) is None and refusal(EXPORT, make(tmp_path / "e"), False) is None
    whole = make(tmp_path / "whole", "config.json", "model.safetensors", "README.md")
    assert refusal(EXPORT, whole, False).startswith(
        "already holds an earlier export (config.json, model.safetensors, README.md); pass --force"
    )
    assert refusal(EXPORT, whole, True) is None
    partial = make(tmp_path / "partial", "config.json", "model.safetensors")  # a training checkpoint: no card
    for force in (False, True):
        assert refusal(EXPORT, partial, force) == (
            "is a drafter checkpoint (config.json, model.safetensors): export writes here; choose another OUT_DIR"
        )
    make(whole, "keep.txt")
    assert (
        refusal(EXPORT, whole, True) == "holds files export did not write (keep.txt): export writes here; choose "
        "another OUT_DIR"
    )
    killed = make(tmp_path / "killed", "report.json", ".report.md.tmp123", ".evaluate.lock")  # its own leftovers
    assert refusal(REPORTS, killed, True) is None and "pass --force" in refusal(REPORTS, killed, False)


def test_a_store_is_found_from_any_path_inside_it(tmp_path):
    store = make(tmp_path / "hs.zarr", "zarr.json", "_commits/", "shards/")
    assert enclosing_store(store) == store == enclosing_store(store / "shards" / "new" / "deeper")
    assert enclosing_store(tmp_path) is None and enclosing_store(make(tmp_path / "z", "zarr.json")) is None
