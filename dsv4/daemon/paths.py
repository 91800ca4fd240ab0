"""Where the daemon lives on disk: endpoint, socket directory, pid file, log file.

* Endpoint: `DSV4_SOCKET` if set, else `ipc://$XDG_RUNTIME_DIR/dsv4/dsv4.sock`, else
  `ipc:///tmp/dsv4-<uid>/dsv4.sock`; `tcp://HOST:PORT` works too. An `ipc://` path is at
  most 107 bytes (`check_endpoint` says so before anything binds or connects).
* Pid file: `<socket path>.pid`, held with an exclusive `flock` for the daemon's life; a
  lock that can be taken means no daemon, and any socket or pid file left is stale.
* Log file (`serve --detach`): `$XDG_STATE_HOME/dsv4/dsv4.log`, else `~/.local/state/dsv4/dsv4.log`.

Trust (both sides, before binding and connecting): the socket directory is no symlink, ours
and 0700 (created so, never chmod-ed; `private_paths.check_private_dir`), the socket a
socket of ours; pid and log files are opened `O_NOFOLLOW`, created 0600, regular and ours.
Any mismatch is an `UnsafePathError` saying what is wrong and how to fix it (exit status 1).
Details: docs/security.md, 'dsv4/daemon/paths.py'.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from pathlib import Path

from dsv4.private_paths import PathError, UnsafePathError, check_private_dir

MAX_IPC_PATH_BYTES = 107
SOCKET_NAME = "dsv4.sock"
HINT = "remove it, or set XDG_RUNTIME_DIR or DSV4_SOCKET (--socket) to a private place"


def _runtime_base() -> Path:
    """`$XDG_RUNTIME_DIR/dsv4` when that directory exists, else `/tmp/dsv4-<uid>`."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "dsv4"
    return Path("/tmp") / f"dsv4-{os.getuid()}"


def default_endpoint() -> str:
    """The endpoint to use when none is given: `DSV4_SOCKET`, else the per-user socket."""
    env = os.environ.get("DSV4_SOCKET", "").strip()
    if env:
        return env
    return f"ipc://{_runtime_base() / SOCKET_NAME}"


def resolve_endpoint(endpoint: str | None) -> str:
    """`endpoint`, or the default; a bare path means `ipc://PATH`. Checked with `check_endpoint`."""
    ep = endpoint.strip() if endpoint else default_endpoint()
    if "://" not in ep:
        ep = f"ipc://{os.path.abspath(ep)}"
    check_endpoint(ep)
    return ep


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an `ipc://` endpoint, None for other transports."""
    if endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://"):])
    return None


def check_endpoint(endpoint: str) -> None:
    """Raise `PathError` for an unsupported transport or an over-long ipc path."""
    scheme = endpoint.split("://", 1)[0]
    if scheme not in ("ipc", "tcp"):
        raise PathError(f"unsupported endpoint {endpoint!r}; use ipc:///path/to/socket or tcp://HOST:PORT")
    path = ipc_path(endpoint)
    if path is None:
        return
    if not path.is_absolute():
        raise PathError(f"socket path {str(path)!r} must be absolute (ipc:///path/to/socket)")
    n = len(os.fsencode(str(path)))
    if n > MAX_IPC_PATH_BYTES:
        raise PathError(f"socket path is {n} bytes, but Unix sockets allow at most {MAX_IPC_PATH_BYTES}: {path}; "
                        f"choose a shorter path with --socket or DSV4_SOCKET")


def state_dir(endpoint: str) -> Path:
    """Directory holding the socket and pid file of `endpoint`."""
    path = ipc_path(endpoint)
    return path.parent if path is not None else _runtime_base()


def pid_file(endpoint: str) -> Path:
    """`<socket>.pid` for ipc; `<runtime dir>/tcp-HOST-PORT.pid` for tcp."""
    path = ipc_path(endpoint)
    if path is not None:
        return path.with_name(path.name + ".pid")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", endpoint.replace("://", "-"))
    return _runtime_base() / f"{name}.pid"


def check_socket_dir(d: Path, *, create: bool) -> bool:
    """The socket directory's trust check (`check_private_dir`); False when it is missing
    and not created."""
    return check_private_dir(d, create=create, what="socket directory", hint=HINT)


def ensure_private_dir(d: Path) -> None:
    """`check_socket_dir(d, create=True)`: the directory exists, is ours and is private."""
    check_socket_dir(d, create=True)


def check_socket_file(path: Path) -> bool:
    """Refuse a socket file that is not a socket of ours; False when there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"{path} is not a socket; {HINT}")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"socket {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                              f"{HINT}")
    return True


def open_private(path: Path, flags: int) -> int:
    """`os.open` with O_NOFOLLOW and O_CREAT (mode 0600); the file must be a regular file of ours."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symlink; {HINT}") from None
        if e.errno == errno.ENXIO:  # O_NONBLOCK write-open of a FIFO nobody reads
            raise UnsafePathError(f"{path} is not a regular file of yours (a FIFO); {HINT}") from None
        raise PathError(f"cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file of yours; {HINT}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o600)  # our own file, say from an older version: make it private
    return fd


def open_log(path: Path) -> int:
    """The detached daemon's log `path` opened for appending: its directory checked (and
    created 0700) as the socket directory is, the file opened O_NONBLOCK (a FIFO there cannot
    hang the open) and O_NOFOLLOW, refused unless a regular file of ours; blocking again once
    checked (it becomes the daemon's stdout and stderr)."""
    check_private_dir(path.parent, create=True, what="log directory",
                      hint="remove it, or set XDG_STATE_HOME to a private place")
    fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def log_file() -> Path:
    """Where a detached daemon writes its log."""
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "dsv4" / "dsv4.log"


class PidLock:
    """The daemon's pid file, held with an exclusive `flock` from `acquire()` to `release()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock and write our pid; False when another live process holds it."""
        for _ in range(5):
            fd = open_private(self.path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False
                raise
            try:  # an exiting daemon may have unlinked the file we opened: lock the live one
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise PathError(f"cannot lock {self.path}: it keeps changing")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        """Remove the pid file (while still holding the lock), then unlock."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def read_pid(path: Path) -> int | None:
    """The pid written in a pid file (never through a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def daemon_pid(endpoint: str) -> int | None:
    """Pid of the daemon holding the lock of `endpoint`, or None when no process holds it."""
    path = pid_file(endpoint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_pid(path) or -1  # locked: a daemon lives (pid maybe not written yet)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def remove_stale(endpoint: str) -> list[Path]:
    """Remove a socket file left by a daemon that died; call only while holding the pid lock."""
    removed = []
    path = ipc_path(endpoint)
    if path is not None and (path.exists() or path.is_symlink()):
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
                removed.append(path)
            else:
                raise PathError(f"{path} exists and is not a socket; remove it or choose another --socket")
        except FileNotFoundError:
            pass
    return removed
