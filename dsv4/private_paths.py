"""Directories that only the current user may control, and the errors that say why one
cannot be trusted.

Both the daemon's socket directory (`dsv4.daemon.paths`) and the compile cache, from
which compiled code is loaded (`dsv4.engine.compile.compiled`), must be directories of ours that
no other user can write to or repoint. The check lives here, below both, so that the
engine does not import the daemon.

A private directory is only as safe as the directories above it: another user who can
write to an ancestor can rename it away and put their own in its place after the check.
`check_trusted_chain` walks the path down from `/` by descriptor (each directory opened
with O_NOFOLLOW relative to the one above, then `fstat`-ed: nothing can be swapped between
two steps) and refuses any directory that a user other than root and us could change.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class PathError(Exception):
    """An endpoint or directory that cannot be used; one-line message with a hint."""


class UnsafePathError(PathError):
    """A directory or file that another user could control (exit status 1)."""


def check_private_dir(d: Path, *, create: bool, what: str, hint: str) -> bool:
    """Refuse a directory another user could control; create it (0700) when missing and `create`.

    True when `d` exists (and is trusted), False when it is missing and not created. `what`
    names the directory in the one-line errors and `hint` says what to do about it: not a
    symlink (`lstat`), a directory, owned by the current user, no group or world access.
    A directory is created that way, never chmod-ed into shape.
    """
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        if not create:
            return False
        try:
            d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(d, 0o700)  # mkdir applies the umask: a stricter mode is still private
        except FileExistsError:
            pass  # created meanwhile: checked below like any other
        except OSError as e:
            raise PathError(f"cannot create the {what} {d}: {e.strerror}") from None
        st = os.lstat(d)
    except OSError as e:
        raise PathError(f"cannot inspect the {what} {d}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {d} is a symlink, which another user could repoint; {hint}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {d} is not a directory; {hint}")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{what} {d} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); {hint}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise UnsafePathError(f"{what} {d} has mode {mode:04o}, open to other users (need 0700); "
                              f"{hint} (or chmod 700 it if it is yours to share with nobody)")
    return True


def check_trusted_chain(d: Path, *, what: str, hint: str) -> None:
    """Refuse `d` unless `/` and every directory down to `d` (its resolved path, `d`
    included) can be changed by nobody but root and us: each owned by root or the current
    user, and not writable by group or others unless sticky (as /tmp: there only an
    entry's owner may rename it, and the next step checks that owner). `d` must exist."""
    real = Path(os.path.realpath(d))
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        here = Path("/")
        for part in [*real.parts[1:], None]:
            st = os.fstat(fd)
            if st.st_uid not in (0, os.getuid()):
                raise UnsafePathError(f"{what} {d}: {here} above it belongs to uid {st.st_uid}, who could replace "
                                      f"what is below; {hint}")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise UnsafePathError(f"{what} {d}: {here} above it has mode {stat.S_IMODE(st.st_mode):04o}, "
                                      f"writable by other users, who could replace what is below; {hint}")
            if part is None:
                return
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise PathError(f"cannot inspect the {what} {d}: {here / part}: {e.strerror}") from None
            os.close(fd)
            fd, here = nfd, here / part
    finally:
        os.close(fd)


def cache_home() -> Path:
    """$XDG_CACHE_HOME when it is absolute, else ~/.cache: where dsv4 keeps per-user caches."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"


def ensure_private_cache(d: Path, *, what: str, parent: bool = True) -> Path:
    """`d` (a cache directory, `cache_home() / "dsv4" / NAME` or one a variable names) and,
    with `parent` (dsv4's own directory above it; not for a directory the user named, which
    may sit in a shared /tmp), its parent created 0700 and checked private, and every
    directory above it trusted (`check_private_dir`, `check_trusted_chain`); raises OSError
    or PathError."""
    d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p in (d.parent, d) if parent else (d,):
        check_private_dir(p, create=True, what=what, hint="remove it or set XDG_CACHE_HOME")
    check_trusted_chain(d, what=what, hint="set XDG_CACHE_HOME to a directory only you control")
    return d

