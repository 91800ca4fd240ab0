"""Repo ids and the hub cache, without the network.

`resolve_model(model, revision)` is the one place a `--model` value becomes a directory:
an existing directory as it is, else a repo id's complete snapshot in the cache (a
`HubError` otherwise, one line that says which: a malformed id, not cached, or cached but
incomplete). The download lives in `dsv4.hub.pull`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# What dsv4 reads of a checkpoint (dsv4/model/checkpoint.py, engine/config.py, tokenizer.py,
# draft_vocab.py): only these are pulled, and only at the top of the repo (not original/...,
# no *.bin or *.pt). `tokenizer*.json`: tokenizer.json and tokenizer_config.json.
ALLOW_PATTERNS = ("config.json", "generation_config.json", "tokenizer*.json", "*.safetensors",
                  "model.safetensors.index.json", "draft_vocab.json")
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_REVISION = "main"
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
# huggingface_hub's rule for a repo id (utils/_validators.py): ORG/NAME of letters, digits,
# '-', '_' and '.', neither part starting or ending with '-' or '.', no '--' or '..', at
# most 96 characters
_PART = r"[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?"
REPO_ID_RE = re.compile(rf"{_PART}/{_PART}")
REPO_ID_MAX = 96
EXIT_USAGE, EXIT_ERROR = 2, 1


class HubError(Exception):
    """A model name that cannot be resolved or pulled; the message is one line. `code` is the
    exit status: 2 for what the user can only fix by changing the input or the environment (a
    malformed id, a repo or revision the hub does not have, no network, not cached, a file
    whose hash is wrong), 1 for a transfer or disk failure that running again may fix."""

    def __init__(self, what: str, code: int = EXIT_USAGE, hint: str = "", no_repo: bool = False) -> None:
        super().__init__(f"{what}; {hint}" if hint else what)
        self.code, self.what = code, what  # `what` without the hint (what to run)
        self.no_repo = no_repo  # the hub has no such repo (a --model that may be a mistyped directory)


@dataclass(frozen=True)
class Snapshot:
    """A repo's files at one commit in the hub cache."""

    repo_id: str
    revision: str  # as asked (main, a tag, a commit)
    commit: str
    path: Path

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}" if self.revision == self.commit else \
            f"{self.repo_id}@{self.revision} ({self.commit[:12]})"


def wanted(path: str) -> bool:
    """A repo file dsv4 reads (ALLOW_PATTERNS, top level only)."""
    return "/" not in path and any(fnmatch.fnmatchcase(path, p) for p in ALLOW_PATTERNS)


def looks_like_repo_id(text: str) -> bool:
    """Meant as ORG/NAME rather than a path: one '/' between two non-empty parts, not
    starting with '/', '.' or '~' (transformers and vLLM: whatever is not a directory)."""
    org, sep, name = text.partition("/")
    return bool(sep and org and name and "/" not in name) and not text.startswith(("/", ".", "~"))


def check_repo_id(text: str) -> str:
    """`text` if it is a valid repo id, else HubError (usage) saying what a repo id is."""
    if REPO_ID_RE.fullmatch(text) and len(text) <= REPO_ID_MAX and ".." not in text and "--" not in text \
            and not text.endswith(".git"):
        return text
    raise HubError(f"{text!r} is not a valid hub repo id: ORG/NAME of letters, digits, '-', '_' and '.' "
                   f"(no '--' or '..', at most {REPO_ID_MAX} characters)")


def cache_dir() -> Path:
    """The hub cache, as huggingface_hub reads it (HF_HUB_CACHE, HF_HOME; at import)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1): no network, the cache only."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def repo_dir(repo_id: str, cache: Path | None = None) -> Path:
    """`models--ORG--NAME` in the cache (huggingface_hub's `repo_folder_name`)."""
    return (cache or cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def read_listing(root: Path, commit: str) -> dict[str, dict] | None:
    """The repo's file listing at `commit` (`trees/COMMIT.json`, huggingface_hub's tree cache,
    written by `dsv4 pull` and by huggingface_hub's `snapshot_download`): path -> {size,
    blob_id, lfs_sha256, lfs_size}; None when there is none or it is unreadable."""
    try:
        data = json.loads((root / "trees" / f"{commit}.json").read_text(encoding="utf-8"))
        if data.get("format_version") != 1 or not isinstance(data.get("files"), dict):
            return None
        return {str(p): dict(v) for p, v in data["files"].items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def write_listing(root: Path, commit: str, files: dict[str, dict]) -> None:
    """Write `trees/COMMIT.json` in huggingface_hub's format (version 1), atomically."""
    path = root / "trees" / f"{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format_version": 1, "files": {p: files[p] for p in sorted(files)}}, indent=1),
                   encoding="utf-8")
    tmp.replace(path)


def commit_of(root: Path, revision: str) -> str | None:
    """The commit `revision` names in the cache: itself when it is a commit hash, else
    `refs/REVISION`; None when the cache does not know it."""
    if COMMIT_RE.fullmatch(revision):
        return revision
    try:
        commit = (root / "refs" / revision).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    return commit if COMMIT_RE.fullmatch(commit) else None


def missing_files(root: Path, commit: str) -> list[str]:
    """The files dsv4 reads that the snapshot lacks: by the repo's listing when there is one,
    else (a snapshot some other tool wrote without it) config.json and the index's shards."""
    snap = root / "snapshots" / commit
    listing = read_listing(root, commit)
    if listing is not None:
        return [p for p in sorted(listing) if wanted(p) and not (snap / p).is_file()]
    need = ["config.json"]
    index = snap / INDEX_NAME
    if index.is_file():
        try:
            need += sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # the checkpoint reader says what is wrong with the index
    missing = [p for p in need if not (snap / p).is_file()]
    if not index.is_file() and not any(snap.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def cached_snapshot(repo_id: str, revision: str | None = None, cache: Path | None = None) -> Snapshot:
    """The complete snapshot of `repo_id` at `revision` in the cache, found without the
    network; HubError (usage) when it is not cached, or cached but incomplete."""
    check_repo_id(repo_id)
    rev = revision or DEFAULT_REVISION
    cache = cache or cache_dir()
    root = repo_dir(repo_id, cache)
    commit = commit_of(root, rev)
    at = "" if revision is None else f" at revision {rev}"
    if commit is None or not (root / "snapshots" / commit).is_dir():
        how = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline()
               else f"'dsv4 pull {repo_id}{'' if revision is None else f' --revision {rev}'}' downloads it")
        raise HubError(f"{repo_id}{at} is not in the hub cache {cache}", hint=how)
    missing = missing_files(root, commit)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise HubError(f"{repo_id}{at} is incomplete in the hub cache (commit {commit[:12]}): {len(missing)} "
                       f"file(s) missing ({', '.join(missing[:3])}{more})",
                       hint=f"'dsv4 pull {repo_id}{'' if revision is None else f' --revision {rev}'}' finishes it")
    return Snapshot(repo_id, rev, commit, root / "snapshots" / commit)


def snapshot_of(path: Path) -> Snapshot | None:
    """The hub model a directory is, when it is a snapshot in a hub cache's layout
    (`.../models--ORG--NAME/snapshots/COMMIT`): its repo id and commit read from the path."""
    p = path.expanduser().absolute()
    repo = p.parent.parent.name
    if p.parent.name != "snapshots" or not COMMIT_RE.fullmatch(p.name) or not repo.startswith("models--"):
        return None
    repo_id = "/".join(repo.split("--")[1:])
    return Snapshot(repo_id, p.name, p.name, p) if looks_like_repo_id(repo_id) else None


def resolve_model(model: str, revision: str | None = None) -> tuple[Path, Snapshot | None]:
    """A `--model` value -> (its directory, the hub snapshot it is, if it is one).

    A path that exists wins, as in transformers and vLLM (with `revision` only if it is a
    snapshot of that commit: a directory has no other revisions); else a repo id resolves
    to its complete cached snapshot, without the network (`dsv4.hub.pull` downloads). A
    value that is neither is a HubError naming both."""
    p = Path(model).expanduser()
    if p.exists():
        snap = snapshot_of(p)
        if revision is not None and (snap is None or revision != snap.commit):
            raise HubError(f"--revision {revision}: --model {model} is a local directory, which has no revisions "
                           f"(--revision applies to a hub model ORG/NAME)")
        return p, snap
    if not looks_like_repo_id(model):
        raise HubError(f"--model {model}: no such directory")
    try:
        check_repo_id(model)
    except HubError as e:
        raise HubError(f"--model {model}: no such directory, and {e}") from None
    try:
        snap = cached_snapshot(model, revision)
    except HubError as e:
        nothing = "" if repo_dir(model).exists() else " no such directory, and"
        raise HubError(f"--model {model}:{nothing} {e}") from None
    return snap.path, snap
