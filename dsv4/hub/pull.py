"""`pull`: download the files dsv4 reads of a hub model into the hub cache.

The transfer is dsv4's own, over plain HTTP through the hub's `resolve` endpoint (which also
serves Xet-backed files), because huggingface_hub's does not do two things it must: resume
(a partial file keeps a stable name, `blobs/ETAG.incomplete`, and the next pull asks for the
rest with `Range: bytes=N-`) and hash (each file is hashed as its bytes arrive and compared
with the hub's listing: the LFS sha256, or the git blob id of a small file; a file that does
not match is refused and deleted, one line naming it, exit 2). The rest is huggingface_hub's
(listing, metadata, token, endpoint, offline mode, the cache, its layout and locks), so the
result is a snapshot transformers and vLLM use as their own. Files go 8 at a time, smallest
first; a dropped connection is retried while it makes progress, then the pull fails with
the partial files kept. Details: docs/models.md, 'dsv4/hub/pull.py'.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol
from urllib.parse import quote, urlparse

from .cache import (COMMIT_RE, DEFAULT_REVISION, EXIT_ERROR, HubError, Snapshot, cache_dir, cached_snapshot,
                    check_repo_id, endpoint, offline, repo_dir, wanted, write_listing)

CHUNK = 1 << 20
WORKERS = 8
STALL_RETRIES = 1  # attempts that may fail in a row without receiving a byte, before the pull gives up
RETRY_DELAY_S = 0.5


class Progress(Protocol):
    """What `pull` reports to: the bytes of every file it wants (`total`), those already on
    disk (`done`, partial files included), then each chunk as it arrives (negative when a
    partial file is found unusable and dropped)."""

    def start(self, total: int, done: int) -> None: ...

    def advance(self, n: int) -> None: ...


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: Optional[int]
    blob_id: Optional[str]  # git object id (sha1 of "blob SIZE\0" + bytes for a file outside LFS)
    sha256: Optional[str]  # LFS files

    @property
    def expected(self) -> tuple[str, Optional[str]]:
        """(hash kind, hex digest the bytes must have)."""
        return ("sha256", self.sha256) if self.sha256 else ("git-sha1", self.blob_id)

    @property
    def blob_name(self) -> Optional[str]:
        """The name the hub's ETag gives its blob (the cache names blobs by ETag)."""
        return self.sha256 or self.blob_id


@dataclass
class PullResult:
    snapshot: Snapshot
    files: int = 0  # files dsv4 reads in the snapshot
    total_bytes: int = 0
    downloaded: list[str] = field(default_factory=list)  # files transferred by this pull
    transferred_bytes: int = 0  # bytes received by this pull
    resumed_bytes: int = 0  # bytes of partial files a former pull left, kept
    cached_only: bool = False  # no network asked (offline, an immutable commit already complete, or unreachable)


class _Cancelled(Exception):
    pass


def _reason(e: BaseException) -> str:
    """A transport error in a few words: 'connection refused', 'timed out', ..."""
    import httpx2

    if isinstance(e, httpx2.TimeoutException):
        return "timed out"
    text = str(e).strip() or type(e).__name__
    low = text.lower()
    if "peer closed connection" in low:
        return "the connection closed mid-file"
    for words in ("connection refused", "name or service not known", "temporary failure in name resolution",
                  "network is unreachable", "no route to host", "connection reset"):
        if words in low:
            return words
    return text.splitlines()[0]


def _status(e: Any) -> str:
    r = getattr(e, "response", None)
    return f"HTTP {r.status_code}" if r is not None else type(e).__name__


def repo_files(repo_id: str, revision: str) -> tuple[str, list[RepoFile]]:
    """(commit, every file of the repo) from the hub's repo info at `revision`; HubError (2)
    naming what is wrong: the repo, the revision, the access; `_Unreachable` when the hub
    cannot be reached or answers 5xx (the cache may then serve)."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    ep = endpoint()
    try:
        info = HfApi(endpoint=ep).model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated on {ep}: accept its terms on its page there, and set HF_TOKEN to a "
                       f"token of that account") from None
    except RepositoryNotFoundError as e:
        raise HubError(f"no model repo {repo_id} on {ep} ({_status(e)}): check the name; a private repo needs "
                       f"HF_TOKEN", no_repo=True) from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} on {ep}") from None
    except HfHubHTTPError as e:
        code = e.response.status_code if getattr(e, "response", None) is not None else 0
        if code >= 500 or code in (408, 429):
            raise _Unreachable(f"it answered {_status(e)}") from None
        raise HubError(f"the hub at {ep} refused {repo_id}: {_status(e)}") from None
    except OfflineModeIsEnabled:
        raise _Unreachable("HF_HUB_OFFLINE=1") from None
    except httpx2.TransportError as e:
        raise _Unreachable(_reason(e)) from None
    if not info.sha or not COMMIT_RE.fullmatch(info.sha):
        raise HubError(f"the hub at {ep} gave no commit for {repo_id} at {revision}; is HF_ENDPOINT a hub?")
    files = [RepoFile(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs is not None else None)
             for s in info.siblings or []]
    return info.sha, files


class _Unreachable(Exception):
    """The hub could not be asked (network, offline mode, 5xx): the reason, in a few words."""


def pull(repo_id: str, revision: str | None = None, *, progress: Progress | None = None,
         warn: Callable[[str], None] | None = None, cache: Path | None = None,
         workers: int = WORKERS) -> PullResult:
    """Bring the files dsv4 reads of `repo_id` at `revision` into the hub cache (what is there
    already is not fetched again) and return the complete snapshot. Without the network
    (HF_HUB_OFFLINE=1, or the hub unreachable: then `warn` is told) a complete cached snapshot
    is returned as it is. Raises HubError (`code` 2 or 1, see `HubError`)."""
    check_repo_id(repo_id)
    rev = revision or DEFAULT_REVISION
    cache = cache or cache_dir()
    if COMMIT_RE.fullmatch(rev):  # a commit never changes: a complete snapshot needs no network
        try:
            return _cached(cached_snapshot(repo_id, rev, cache))
        except HubError:
            pass
    if offline():
        return _cached(cached_snapshot(repo_id, revision, cache))
    try:
        commit, files = repo_files(repo_id, rev)
    except _Unreachable as e:
        ep = endpoint()
        try:
            snap = cached_snapshot(repo_id, revision, cache)
        except HubError as cache_error:
            raise HubError(f"cannot reach the hub at {ep} ({e}), and {cache_error.what}") from None
        if warn is not None:
            warn(f"dsv4: warning: cannot reach the hub at {ep} ({e}); using the cached {snap.label}")
        return _cached(snap)
    return _Pull(repo_id, rev, commit, files, cache, progress, workers).run()


def _cached(snap: Snapshot) -> PullResult:
    return PullResult(snap, cached_only=True)


class _Pull:
    def __init__(self, repo_id: str, revision: str, commit: str, files: list[RepoFile], cache: Path,
                 progress: Progress | None, workers: int) -> None:
        self.repo_id, self.revision, self.commit, self.cache = repo_id, revision, commit, cache
        self.all_files = files
        self.files = sorted((f for f in files if wanted(f.path)), key=lambda f: (f.size or 0, f.path))
        self.root = repo_dir(repo_id, cache)
        self.snap = self.root / "snapshots" / commit
        self.progress = progress
        self.workers = workers
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.transferred = 0

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(n)

    def run(self) -> PullResult:
        names = {f.path for f in self.files}
        at = f"{self.repo_id}@{self.revision}"
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            lacks = "config.json" if "config.json" not in names else "*.safetensors files"
            raise HubError(f"{at} has no {lacks}: dsv4 serves DeepSeek V4 checkpoints in safetensors "
                           f"(config.json, *.safetensors, tokenizer.json)")
        self.root.mkdir(parents=True, exist_ok=True)
        if all(f.size is not None and f.blob_id for f in self.all_files):
            listing = {f.path: {"size": f.size, "blob_id": f.blob_id,
                                **({"lfs_sha256": f.sha256, "lfs_size": f.size} if f.sha256 else {})}
                       for f in self.all_files}
            write_listing(self.root, self.commit, listing)  # what a complete snapshot holds (cache.missing_files)
        self.snap.mkdir(parents=True, exist_ok=True)  # before its ref: a ref to no snapshot is a corrupt cache
        if self.revision != self.commit:
            _write_ref(self.root, self.revision, self.commit)
        todo = [f for f in self.files if not (self.snap / f.path).is_file()]
        total = sum(f.size or 0 for f in self.files)
        partial = {f.path: _partial_size(self.root, f) for f in todo}
        resumed = sum(partial.values())
        need = sum((f.size or 0) - partial[f.path] for f in todo
                   if not (f.blob_name and (self.root / "blobs" / f.blob_name).is_file()))
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise HubError(f"{at} needs {_gb(need)} more in the hub cache {self.cache}, which has {_gb(free)} free",
                           EXIT_ERROR)
        if self.progress is not None:
            self.progress.start(total, total - sum((f.size or 0) for f in todo) + resumed)
        errors = self._fetch_all(todo)
        if errors:
            raise _first(errors, at)
        snap = cached_snapshot(self.repo_id, self.revision, self.cache)  # complete now, by the listing
        return PullResult(snap, files=len(self.files), total_bytes=total,
                          downloaded=[f.path for f in todo], transferred_bytes=self.transferred,
                          resumed_bytes=resumed)

    def _fetch_all(self, todo: list[RepoFile]) -> list[HubError]:
        errors: list[HubError] = []
        if not todo:
            return errors
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(todo))), thread_name_prefix="dsv4-pull")
        try:
            futures = [pool.submit(self._fetch, f) for f in todo]
            for fut in as_completed(futures):
                e = fut.exception()
                if isinstance(e, HubError):
                    errors.append(e)
                elif isinstance(e, _Cancelled):
                    pass
                elif e is not None:
                    raise e
        except BaseException:
            self.stop.set()  # Ctrl-C: the others stop at their next chunk; partial files stay for a resume
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return errors

    def _fetch(self, f: RepoFile) -> None:
        """One file into blobs/ (downloaded, or already there) and linked into the snapshot."""
        import httpx2
        from huggingface_hub import get_hf_file_metadata
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import WeakFileLock, build_hf_headers

        if self.stop.is_set():
            raise _Cancelled
        ep = endpoint()
        url = f"{ep}/{self.repo_id}/resolve/{self.commit}/{quote(f.path)}"  # as hf_hub_url builds it
        try:
            meta = get_hf_file_metadata(url, endpoint=ep)
        except HfHubHTTPError as e:
            raise HubError(f"{f.path}: the hub answered {_status(e)} for its metadata", EXIT_ERROR) from None
        except httpx2.TransportError as e:
            raise HubError(f"{f.path}: cannot reach the hub at {ep} ({_reason(e)}); run the pull again",
                           EXIT_ERROR) from None
        kind, want = f.expected
        etag = meta.etag or f.blob_name
        if want and etag and len(etag) == len(want) and etag != want:
            raise HubError(f"{f.path}: the hub's ETag {etag[:16]} and its listing's {kind} {want[:16]} disagree; "
                           f"not downloaded")
        if not etag:
            raise HubError(f"{f.path}: the hub gave no ETag, so the file cannot be named or checked")
        size = f.size if f.size is not None else meta.size
        if f.size is not None and meta.size is not None and f.size != meta.size:
            raise HubError(f"{f.path}: the hub's listing says {f.size} bytes, its file metadata {meta.size}; "
                           f"not downloaded")
        headers = build_hf_headers()
        if _origin(meta.location) != _origin(url):  # a CDN: the token stays on the hub
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        blob = self.root / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = self.cache / ".locks" / self.root.name / f"{etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            if not blob.is_file():
                self._download(f, meta.location, headers, blob, size, kind, want)
            _link(self.snap / f.path, blob)

    def _download(self, f: RepoFile, url: str, headers: dict[str, str], blob: Path, size: Optional[int],
                  kind: str, want: Optional[str]) -> None:
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session, hf_raise_for_status
        from huggingface_hub.errors import HfHubHTTPError

        part = blob.with_name(blob.name + ".incomplete")
        hasher = _hasher(kind, size)
        have = part.stat().st_size if part.is_file() else 0
        if size is not None and have > size:  # not the file advertised now: start again
            self.advance(-_partial_size(self.root, f))
            part.unlink()
            have = 0
        elif have:
            with part.open("rb") as fh:
                while chunk := fh.read(8 * CHUNK):
                    hasher.update(chunk)
        stalls = 0
        while size is None or have < size:
            got = 0
            hdrs = {**headers, "Accept-Encoding": "identity"}
            if have:
                hdrs["Range"] = f"bytes={have}-"
            try:
                with get_session().stream("GET", url, headers=hdrs, follow_redirects=True,
                                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
                    if r.status_code == 416 and have:  # nothing past what we have: the hash decides
                        break
                    hf_raise_for_status(r)
                    if have and r.status_code != 206:  # the server ignored Range: from the start
                        self.advance(-have)
                        have, hasher = 0, _hasher(kind, size)
                    elif have and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                        raise HubError(f"{f.path}: asked for bytes from {have}, the server answered "
                                       f"{r.headers.get('Content-Range')!r}", EXIT_ERROR)
                    with part.open("ab" if have else "wb") as out:
                        for chunk in r.iter_bytes():  # as received: nothing buffered is lost to a drop
                            if self.stop.is_set():
                                raise _Cancelled
                            out.write(chunk)
                            hasher.update(chunk)
                            have += len(chunk)
                            got += len(chunk)
                            self.advance(len(chunk))
                            if size is not None and have > size:
                                break
                if size is None:
                    size = have
                if got == 0 and have < size:
                    raise httpx2.RemoteProtocolError("the server sent no bytes")
            except HfHubHTTPError as e:
                raise HubError(f"{f.path}: the download failed: {_status(e)}", EXIT_ERROR) from None
            except httpx2.TransportError as e:
                stalls = 0 if got else stalls + 1
                if stalls > STALL_RETRIES:
                    raise HubError(f"{f.path}: the download was interrupted at {_gb(have)} of {_gb(size or 0)} "
                                   f"({_reason(e)}); run the pull again to resume it", EXIT_ERROR) from None
                time.sleep(RETRY_DELAY_S)
                continue
            finally:
                with self.lock:
                    self.transferred += got
        if have != size or (want and hasher.hexdigest() != want):
            got_hash = hasher.hexdigest()
            part.unlink(missing_ok=True)
            if have != size:
                raise HubError(f"{f.path}: the server sent {have} bytes, the hub's listing says {size}; refused and "
                               f"removed")
            raise HubError(f"{f.path}: {kind} {got_hash[:16]}... does not match the hub's {want[:16]}...; "
                           f"refused and removed")
        os.replace(part, blob)


def _hasher(kind: str, size: Optional[int]) -> Any:
    if kind == "sha256":
        return hashlib.sha256()
    h = hashlib.sha1()  # git's blob id: sha1 of the header "blob SIZE\0" and the bytes
    h.update(b"blob %d\0" % (size or 0))
    return h


def _partial_size(root: Path, f: RepoFile) -> int:
    if not f.blob_name:
        return 0
    p = root / "blobs" / f"{f.blob_name}.incomplete"
    try:
        n = p.stat().st_size
    except OSError:
        return 0
    return n if f.size is None or n <= f.size else 0


def _origin(url: str) -> tuple[str, str, int]:
    u = urlparse(url)
    return u.scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme, 0)


def _link(pointer: Path, blob: Path) -> None:
    """snapshots/COMMIT/PATH -> ../../blobs/ETAG (relative, as huggingface_hub links), atomically."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:  # a filesystem without symlinks: a copy, as huggingface_hub falls back to
        shutil.copyfile(blob, tmp)
    os.replace(tmp, pointer)


def _write_ref(root: Path, revision: str, commit: str) -> None:
    ref = root / "refs" / revision
    try:
        if ref.read_text(encoding="utf-8").strip() == commit:
            return
    except OSError:
        pass
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(commit, encoding="utf-8")
    tmp.replace(ref)


def _first(errors: list[HubError], at: str) -> HubError:
    """The error to report of several files' (a refused hash first), with how many more failed."""
    errors = sorted(errors, key=lambda e: e.code != 2)
    e = errors[0]
    more = f" ({len(errors) - 1} more file(s) failed too)" if len(errors) > 1 else ""
    return HubError(f"{at}: {e}{more}", e.code)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
