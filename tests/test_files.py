"""mpisgd.files' checks of output places, where their messages depend on the operating system's answer."""

from __future__ import annotations

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
    check_output_dir(str(tmp_path / "new" / "deep"), "--checkpoint-dir")  # made, and writable
    assert (tmp_path / "new" / "deep").is_dir() and not list((tmp_path / "new" / "deep").iterdir())
