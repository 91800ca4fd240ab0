"""The connection sentinel: a small process that shuts the daemon's ipc socket file when a flood nears the descriptor limit.

libzmq aborts the whole process when an ipc accept fails for lack of descriptors (EMFILE).
`ConnectionGuard` (intake.py) unbinds before that, but it is a Python thread: on a loaded
machine the GIL and the scheduler can keep it off the CPU for longer than a same-user flood of
local connects takes to use up the headroom (600 connects land in ~40 ms). The sentinel is a
process of its own (its own interpreter, standard library only) holding a copy of the listening
socket: a pending connect wakes it as it wakes libzmq. It then counts the daemon's open
descriptors in /proc/PID/fd every FAST_S for FAST_FOR_S (and every IDLE_S anyway), and under the
guard's low-water mark it shuts the door: it puts a socket nobody listens on in place of the
socket file, so that new connects are refused in the kernel at once (as after an unbind:
clients retry, and `dsv4` commands still find a socket file), and tells the guard, which unbinds
and, after its pause, binds again. It never replaces a file other than the one the daemon bound
(same device, inode and change time).

Messages: the sentinel writes READY on its stdout once it runs (the daemon binds after it) and
CLOSED when descriptors ran low; the daemon sends on its stdin (a Unix socket) BOUND with the
listening socket, UNBOUND, and ARM (accepts seen); end of file stops it.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time

IDLE_S = 0.2  # between looks while nothing happens (a pending connect wakes it at once)
BLIND_S = 0.05  # the same without the listening socket (not found): the guard's ARM, or this
FAST_S = 0.001
FAST_FOR_S = 0.05  # after a wake, and after every look that finds more descriptors than the last
STUCK_S = 2.0  # a listener readable this long with the count still: nobody accepts (a stopped daemon)
ARM, BOUND, UNBOUND, CLOSED, READY = b"a", b"b", b"u", b"c", b"r"
ARM_EVERY_S = 0.05  # the guard's reports of accepts, at most this often
READY_WAIT_S = 10.0
ACCEPTING = 0x10000  # /proc/net/unix Flags: a listening socket (__SO_ACCEPTCON)


def _ident(path: str) -> tuple[int, int, int] | None:
    """(device, inode, change time) of the socket at `path`, None if there is none (or it is
    no socket): a file made later at the path differs, even where its inode number is reused."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def _shut(name: str) -> None:
    """Put a socket that nobody listens on (mode 0600) in place of `name` (in the working
    directory: the socket's), atomically: connects are refused at once. Made under a short
    spare name there first (a relative name stays within the socket path limit)."""
    spare = f".{name}~"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            os.unlink(spare)  # one left by a sentinel killed mid-way
        except FileNotFoundError:
            pass
        s.bind(spare)
        try:
            os.chmod(spare, 0o600)
            os.rename(spare, name)
        except OSError:
            os.unlink(spare)
            raise


def watch(pid: int, path: str, limit: int, low_water: int, chan: socket.socket, outbox: int) -> None:
    """The sentinel's loop (in its own process); returns when the daemon closes `chan` or exits.
    `path` is absolute; the loop works in its directory and names the socket file relatively."""
    fd_dir = f"/proc/{pid}/fd"
    os.chdir(os.path.dirname(path))
    name = os.path.basename(path)
    ident, listener, closed = None, None, True  # nothing to guard until the daemon says BOUND
    os.write(outbox, READY)
    last, fast_until, stuck_since = 0, 0.0, None
    while True:
        now = time.monotonic()
        fast = now < fast_until
        stuck = stuck_since is not None and now - stuck_since >= STUCK_S
        waits = [chan] if fast or stuck or listener is None else [chan, listener]  # a pending connect: look
        ready, _, _ = select.select(waits, [], [], FAST_S if fast else IDLE_S if listener is not None else BLIND_S)
        armed = False
        if chan in ready:
            data, fds, _, _ = socket.recv_fds(chan, 256, 4)
            if not data:
                return  # the daemon is gone, or stopping
            said = None
            for msg in data:
                if msg == BOUND[0]:
                    ident, closed, said = _ident(name), False, BOUND
                elif msg == UNBOUND[0]:
                    ident, closed, said = None, True, UNBOUND
                armed = armed or msg == ARM[0]
            if said is not None and listener is not None:
                os.close(listener)
                listener = stuck_since = None
            # a read ends with the byte that carried descriptors: they are that BOUND's
            if said == BOUND and fds and data[-1:] == BOUND:
                listener = fds.pop()
            for fd in fds:
                os.close(fd)
        woke = listener is not None and listener in ready
        try:
            n = len(os.listdir(fd_dir))
        except FileNotFoundError:
            return  # the daemon exited
        except OSError as e:  # not ours to read (hidepid, a changed owner): the guard works alone
            print(f"dsv4 connection sentinel: cannot count the daemon's descriptors: {e}", file=sys.stderr, flush=True)
            return
        if n != last:
            stuck_since = None
        elif woke and stuck_since is None:
            stuck_since = time.monotonic()
        if woke or armed or n > last:  # connects arriving: look often while the count grows
            fast_until = time.monotonic() + FAST_FOR_S
        last = n
        if limit - n < low_water and not closed:
            if ident is not None and _ident(name) == ident:
                try:
                    _shut(name)
                except OSError as e:  # the guard unbinds all the same
                    print(f"dsv4 connection sentinel: cannot shut {path}: {e}", file=sys.stderr, flush=True)
            if listener is not None:
                os.close(listener)
                listener = None
            closed = True
            os.write(outbox, CLOSED)


def listening_fd(path: str, skip: set[int]) -> tuple[int, int] | None:
    """(descriptor, socket inode) of this process's listening socket bound at `path` (libzmq's,
    found through /proc/net/unix and /proc/self/fd), other than the sockets in `skip`."""
    inodes = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.rstrip("\n").split(None, 7)
                if len(parts) == 8 and parts[7] == path and int(parts[3], 16) & ACCEPTING:
                    inodes.add(int(parts[6]))
        names = os.listdir("/proc/self/fd")
    except (OSError, ValueError, StopIteration):
        return None
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and (inode := int(link[8:-1])) in inodes - skip:
            return int(name), inode
    return None


class Sentinel:
    """The daemon's handle on its sentinel process (one per bound ipc endpoint)."""

    def __init__(self, path: str, limit: int, low_water: int) -> None:
        """`path`: the socket file, absolute and as bound (the string /proc/net/unix shows)."""
        self.path = path
        self._chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(os.getpid()), path, str(limit), str(low_water)],
                stdin=theirs, stdout=subprocess.PIPE, close_fds=True)
        except OSError:
            self._chan.close()
            raise
        finally:
            theirs.close()
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self._chan.setblocking(False)
        os.set_blocking(self.fd, False)
        self._armed_at = 0.0
        self._known: set[int] = set()  # listening sockets already handed over
        try:
            waiting = select.poll()  # not select(): the daemon's descriptors may number over 1024
            waiting.register(self.fd, select.POLLIN)
            if not waiting.poll(READY_WAIT_S * 1000) or os.read(self.fd, 1) != READY:
                raise OSError("the connection sentinel did not start")
        except BaseException:
            self.close()
            raise

    def _send(self, msg: bytes, fds: list[int] | None = None) -> None:
        try:
            socket.send_fds(self._chan, [msg], fds or [])
        except OSError:
            pass  # full: the sentinel is looking already; dead: only the backstop is lost

    def arm(self) -> None:
        """Accepts are arriving: look every FAST_S for a while (at most once per ARM_EVERY_S)."""
        now = time.monotonic()
        if now - self._armed_at >= ARM_EVERY_S:
            self._armed_at = now
            self._send(ARM)

    def bound(self) -> None:
        """The endpoint is bound (again): a new socket file to guard, and its listening socket
        (libzmq's, when it can be found) to wake on."""
        found = listening_fd(self.path, self._known)
        if found is not None:
            self._known.add(found[1])
        self._send(BOUND, [found[0]] if found is not None else None)

    def unbound(self) -> None:
        """The endpoint is about to be unbound: drop the copy of its listening socket, guard
        nothing until `bound()`. Until the sentinel reads this, connects still queue in the
        copy's backlog (no descriptor of the daemon's); dropping it resets them, and ZeroMQ
        clients connect again."""
        self._send(UNBOUND)

    def said_low(self) -> bool | None:
        """Whether the sentinel saw descriptors run low (and shut the door) since the last call;
        None once it has exited (its pipe at end of file)."""
        try:
            data = os.read(self.fd, 256)
        except OSError:  # nothing to read
            return False
        return None if not data else CLOSED in data

    def close(self) -> None:
        self._chan.close()  # end of file: the sentinel returns
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start(path: str, limit: int | None, low_water: int | None) -> Sentinel | None:
    """A sentinel for the socket file `path`, or None where it cannot work (no descriptor
    limit, no /proc) or cannot start (the guard then works alone)."""
    if limit is None or low_water is None or not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return None
    try:
        return Sentinel(path, limit, low_water)
    except Exception as e:  # noqa: BLE001 (the backstop is optional: the daemon serves without it)
        logging.getLogger("dsv4.daemon").warning("no connection sentinel (%s): the connection guard works alone", e)
        return None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the daemon's terminal is the daemon's
    _pid, _path, _limit, _low = sys.argv[1:5]
    watch(int(_pid), _path, int(_limit), int(_low), socket.socket(fileno=sys.stdin.fileno()), sys.stdout.fileno())
