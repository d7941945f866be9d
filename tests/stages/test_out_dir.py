"""stages/out_dir.py: what a failed run created and left empty goes; nothing else does."""

import pytest

from stages.out_dir import removed_if_failed_empty


def names(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def fail(out, **kw):
    with pytest.raises(RuntimeError), removed_if_failed_empty(out, **kw):
        out.mkdir(parents=True, exist_ok=True)
        (out / ".launch").write_text("token")
        raise RuntimeError("the run failed")


def test_a_failed_run_removes_the_directories_it_made_deepest_first(tmp_path):
    fail(tmp_path / "runs" / "a" / "b", scratch=(".launch",))
    assert names(tmp_path) == []


def test_what_holds_anything_else_or_was_there_before_stays(tmp_path):
    fail(tmp_path / "runs" / "a")  # .launch is not scratch here: runs/a holds a file
    assert names(tmp_path) == ["runs", "runs/a", "runs/a/.launch"]
    (tmp_path / "there").mkdir()
    with pytest.raises(RuntimeError), removed_if_failed_empty(tmp_path / "there"):
        raise RuntimeError
    assert (tmp_path / "there").is_dir()
    with pytest.raises(RuntimeError), removed_if_failed_empty(tmp_path / "x" / "y"):
        (tmp_path / "x" / "y").mkdir(parents=True)
        (tmp_path / "x" / "z").write_text("a sibling the run wrote")
        raise RuntimeError
    assert names(tmp_path / "x") == ["z"]  # y went, x holds z


def test_a_run_that_succeeds_or_is_not_the_owner_keeps_everything(tmp_path):
    with removed_if_failed_empty(tmp_path / "ok"):
        (tmp_path / "ok").mkdir()
    fail(tmp_path / "other", owner=False, scratch=(".launch",))  # another process of a launch
    assert names(tmp_path) == ["ok", "other", "other/.launch"]
