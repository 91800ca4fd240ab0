"""The detached daemon's log (issue 21): a FIFO planted at the log path is refused at once
(it hung `serve --detach` in its open before), and the log directory is checked as the
socket directory is (ours, not a symlink, 0700)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from dsv4.daemon import paths
from dsv4.private_paths import UnsafePathError
from tests.e2e.util import CMD


@pytest.fixture
def state() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsv4t-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_fifo_at_the_log_path_is_refused_not_waited_on(state: Path) -> None:
    (state / "dsv4").mkdir(mode=0o700)
    os.mkfifo(state / "dsv4" / "dsv4.log", 0o600)
    env = {**os.environ, "XDG_STATE_HOME": str(state), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*CMD, "serve", "--detach", "--socket", f"ipc://{state}/d.sock"], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == (f"dsv4: {state}/dsv4/dsv4.log is not a regular file of yours (a FIFO); "
                                f"{paths.HINT}")
    assert not (state / "d.sock").exists()
    reader = os.open(state / "dsv4" / "dsv4.log", os.O_RDONLY | os.O_NONBLOCK)  # with a reader too
    try:
        with pytest.raises(UnsafePathError, match="is not a regular file of yours"):
            paths.open_log(state / "dsv4" / "dsv4.log")
    finally:
        os.close(reader)


def test_log_directory_checked_as_the_socket_directory(state: Path) -> None:
    (state / "dsv4").mkdir()
    os.chmod(state / "dsv4", 0o777)  # another user could swap the log for a link to anything
    with pytest.raises(UnsafePathError, match=r"^log directory .*/dsv4 has mode 0777, open to other users"):
        paths.open_log(state / "dsv4" / "dsv4.log")
    os.rmdir(state / "dsv4")
    (state / "elsewhere").mkdir(mode=0o700)
    (state / "dsv4").symlink_to(state / "elsewhere")
    with pytest.raises(UnsafePathError, match=r"^log directory .*/dsv4 is a symlink"):
        paths.open_log(state / "dsv4" / "dsv4.log")
    os.unlink(state / "dsv4")
    fd = paths.open_log(state / "new" / "dsv4" / "dsv4.log")  # created private, blocking
    try:
        assert os.stat(state / "new" / "dsv4").st_mode & 0o777 == 0o700
        assert os.get_blocking(fd) and os.fstat(fd).st_mode & 0o777 == 0o600
    finally:
        os.close(fd)
