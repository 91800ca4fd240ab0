"""`dsv4 pull` and `dsv4 models`, and `fetch_model`: --model ORG/NAME for the other commands.

`serve`, `run --local`, `bench --local`, `convert` and `draft-vocab` pull a hub model that is
missing from the cache before using it, as vLLM does (`fetch_model`; a complete model costs
one request to the hub, none with HF_HUB_OFFLINE=1 or once the revision is pinned to a
commit); the engine then finds it in the cache without the network (`dsv4.hub.cache`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dsv4.cli import options as O
from dsv4.cli.options import CliError

RepoId = Annotated[str, typer.Argument(metavar="ORG/NAME", show_default=False,
                                       help="The model's repo id on the Hugging Face hub (HF_ENDPOINT).")]
PullRevision = Annotated[Optional[str], typer.Option(
    "--revision", metavar="REV", show_default=False,
    help="The branch, tag or commit to pull [default: main]")]


class PullProgress:
    """A rich progress bar on stderr when it is a terminal (bytes done of the total, speed,
    time left); otherwise one line when the transfer starts."""

    def __init__(self, label: str, enabled: bool | None = None, console: Any = None) -> None:
        self.label = label
        self._bar: Any = None
        self._task: Any = None
        if enabled if enabled is not None else sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 console=console or Console(stderr=True), transient=True)

    def start(self, total: int, done: int) -> None:
        if total <= done:
            return
        if self._bar is None:
            O.err(f"dsv4: pulling {self.label}: {_size(total - done)} to download of {_size(total)}")
            return
        self._task = self._bar.add_task(self.label, total=total, completed=done)
        self._bar.start()

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._task is not None:
            self._bar.stop()
            self._task = None


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def pull_model(repo_id: str, revision: str | None, *, quiet_if_cached: bool = False, flag: str = "") -> Any:
    """`dsv4.hub.pull.pull` with a progress bar and one summary line on stderr; HubError -> CliError
    (a repo the hub does not have, named by `flag`: "--model X: no such directory, and ...")."""
    from dsv4.hub.cache import HubError
    from dsv4.hub.pull import pull

    label = repo_id + ("" if revision is None else f"@{revision}")
    progress = PullProgress(label, enabled=False if O.under_torchrun() else None)  # one bar, not one a rank
    t0 = time.monotonic()
    try:
        result = pull(repo_id, revision, progress=progress, warn=O.err)
    except HubError as e:
        raise CliError(f"{flag} {repo_id}: no such directory, and {e}" if flag and e.no_repo else str(e),
                       e.code) from None
    finally:
        progress.close()
    snap = result.snapshot
    if result.downloaded:
        resumed = (f" (and {_size(result.resumed_bytes)} kept from an interrupted pull)" if result.resumed_bytes
                   else "")
        O.err(f"dsv4: pulled {snap.label}: {len(result.downloaded)} of {result.files} files, "
              f"{_size(result.transferred_bytes)} transferred{resumed}, in {time.monotonic() - t0:.1f} s")
    elif not quiet_if_cached:
        O.err(f"dsv4: {snap.label} is complete in the hub cache")
    return result


def fetch_model(kw: dict[str, Any], flag: str = "--model") -> None:
    """Engine kwargs whose --model is a hub model ORG/NAME (not a directory): pull what the
    cache lacks, then pin kw["revision"] to the commit, so the engine, a detached daemon and
    the other ranks all resolve that snapshot from the cache without the network. Anything
    else is left for EngineConfig to check."""
    from dsv4.hub.cache import HubError, check_repo_id, looks_like_repo_id

    model = kw.get("model")
    if not isinstance(model, str) or Path(model).expanduser().exists() or not looks_like_repo_id(model):
        return
    try:
        check_repo_id(model)
    except HubError as e:
        raise CliError(f"{flag} {model}: no such directory, and {e}", O.EXIT_USAGE) from None
    kw["revision"] = pull_model(model, kw.get("revision"), quiet_if_cached=True, flag=flag).snapshot.commit


def model_dir(model: str, revision: str | None, what: str = "--model") -> Path:
    """A checkpoint directory or a hub model (pulled when missing) -> its directory (for
    `convert` and `draft-vocab`, which read a checkpoint without an engine)."""
    from dsv4.hub.cache import HubError, resolve_model

    kw: dict[str, Any] = {"model": model, "revision": revision}
    fetch_model(kw, what)
    try:
        return resolve_model(model, kw["revision"])[0]
    except HubError as e:
        raise CliError(str(e).replace("--model", what, 1), e.code) from None


def pull(repo_id: RepoId, revision: PullRevision = None) -> None:
    """Download a hub model into the hub cache: only the files dsv4 reads, resumable, every file's hash
    checked; prints the snapshot's directory."""
    from dsv4.hub.cache import HubError, check_repo_id

    try:
        check_repo_id(repo_id)
    except HubError as e:
        raise CliError(str(e), O.EXIT_USAGE) from None
    print(pull_model(repo_id, revision).snapshot.path)


def models(as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False) -> None:
    """List the models in the hub cache: revision, size, format, stored weight bytes and whether they fit."""
    from dsv4.hub.cache import cache_dir
    from dsv4.hub.listing import cached_models

    rows = cached_models()
    if as_json:
        print(json.dumps([r.as_json() for r in rows], indent=2))
        return
    if not rows:
        O.err(f"dsv4: no models in the hub cache {cache_dir()}; 'dsv4 pull ORG/NAME' downloads one")
        return
    table = [("MODEL", "REVISION", "COMMIT", "SIZE", "FORMAT", "WEIGHTS", "FITS")]
    for r in rows:
        fmt = r.format
        if r.model_type != "deepseek_v4":
            fmt = f"not DeepSeek V4 ({r.model_type or 'no model_type'})"
        elif r.missing:
            fmt += f", incomplete: {len(r.missing)} file(s) missing"
        if r.fits is None:
            fits = "-"
        else:
            fits = f"{'yes' if r.fits else 'no'} ({_size(r.available_bytes or 0)} available)"
        table.append((r.repo_id, ",".join(r.refs) or "-", r.commit[:12], _size(r.size_on_disk), fmt,
                      _size(r.weight_bytes) if r.weight_bytes else "-", fits))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    O.err(f"dsv4: {cache_dir()}; WEIGHTS: the tensors' stored bytes (safetensors headers); FITS: WEIGHTS against "
          f"the memory available now (loading may need more: FP8/FP4 dequantised to --dtype, request state)")
