"""store/io/file_modes.py: the umask read without changing it, files given the mode it says."""

import os

import pytest

from store.io import file_modes
from tests.modes import file_modes as modes_of
from tests.modes import umask


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027])
def test_the_umask_is_read_as_set_and_left_as_it_was(mask):
    with umask(mask):
        assert file_modes.umask() == mask
        assert file_modes.file_mode() == 0o666 & ~mask
        assert os.umask(mask) == mask  # reading it changed nothing


@pytest.mark.parametrize("mask, mode", [(0o022, "0644"), (0o077, "0600"), (0o007, "0660")])
def test_files_written_owner_only_get_the_mode_open_gives(tmp_path, mask, mode):
    with umask(mask):
        (tmp_path / "plain").write_text("x")  # what open() makes: the reference
        for name in ("a", "sub/b"):
            p = tmp_path / "tree" / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("x")
            p.chmod(0o600)  # as safetensors writes it
        file_modes.tree_as_umask(tmp_path / "tree")
    assert modes_of(tmp_path) == {"plain": mode, "tree/a": mode, "tree/sub/b": mode}


def test_a_file_of_another_owner_is_left_as_it_is(tmp_path):
    """Another node's rank may write a shared directory under another uid: chmod would fail there."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for p in (mine, theirs):
        p.write_text("x")
        p.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        pytest.skip("only root can give a file to another owner")
    with umask(0o022):
        file_modes.tree_as_umask(tmp_path)
    assert modes_of(tmp_path) == {"mine": "0644", "theirs": "0600"}
