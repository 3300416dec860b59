"""mpisgd.files' checks of output places, where their messages depend on the operating system's answer."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from mpisgd.errors import UsageError
from mpisgd.files import check_output_dir


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_directory_that_takes_no_new_files_is_said_so_not_no_such_file():
    """/proc exists, and creating a file there fails with ENOENT: the message says what is wrong."""
    with pytest.raises(UsageError) as info:
        check_output_dir("/proc", "--json")
    assert str(info.value) == "--json /proc: cannot write there (it takes no new files)"


def test_a_file_in_the_way_and_a_place_that_cannot_be_made(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        check_output_dir(str(tmp_path / "f"), "--checkpoint-dir")
    with pytest.raises(UsageError, match=r"cannot create the directory \(Not a directory\)"):
        check_output_dir(str(tmp_path / "f" / "sub"), "--checkpoint-dir")
    (tmp_path / "kept").mkdir()
    for where in ("new/deep", "kept/deep", "kept"):  # writable, and left as found (the writers make it)
        check_output_dir(str(tmp_path / where), "--checkpoint-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "kept"] and not list((tmp_path / "kept").iterdir())


def test_a_link_to_nothing_or_a_name_too_long_on_the_way_is_refused_before_training(tmp_path):
    """The writers' mkdir would fail on them after the training: found now, the link named."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for where in ("gone", "gone/deeper"):
        with pytest.raises(UsageError, match=r"cannot create the directory \(.*/gone is a symbolic link to "
                                             r".*/nowhere, which does not exist\)"):
            check_output_dir(str(tmp_path / where), "--checkpoint-dir")
    with pytest.raises(UsageError, match=r"cannot create the directory \(File name too long\)"):
        check_output_dir(str(tmp_path / "new" / ("x" * 300)), "--checkpoint-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone"]


def test_a_place_whose_parent_cannot_take_files_is_refused_and_nothing_is_made(tmp_path, monkeypatch):
    def no_space(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", no_space)
    with pytest.raises(UsageError, match=r"--tensorboard .*/a/b: cannot create the directory \(No space left"):
        check_output_dir(str(tmp_path / "a" / "b"), "--tensorboard")
    with pytest.raises(UsageError, match=r"--tensorboard .*: cannot write there \(No space left on device\)"):
        check_output_dir(str(tmp_path), "--tensorboard")
    assert not list(tmp_path.iterdir())
