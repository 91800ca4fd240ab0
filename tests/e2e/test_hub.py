"""Models by name, end to end: the real `dsv4` CLI against a local stand-in for the Hugging
Face hub (tests/hubserver.py, HF_ENDPOINT pointing at it) serving the embedded model.

`pull` then `run --local --model ORG/NAME` offline from the cached snapshot; what is pulled
(only what dsv4 reads) and how (no token to the CDN, no Xet); an interrupted download
resumed by the next pull, which transfers only the rest; a file whose bytes do not match
the hub's sha256 refused; a repo the hub does not have, a hub that is down, offline with
and without the model, malformed ids, --revision, a private repo, `dsv4 models` (and
--json), the progress bar on a terminal, and a cache shared with huggingface_hub itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import dsv4
from tests.e2e.util import CMD, dsv4 as run_dsv4, env_for, free_port
from tests.hubserver import FakeHub

TINY = Path(dsv4.DEFAULT_MODEL)
REPO = "tiny/shakespeare"
PULLED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
WEIGHTS = (TINY / "model.safetensors").stat().st_size
GREEDY = b'{"do_sample": false}'
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    h = FakeHub()
    extra = {"pytorch_model.bin": b"\0" * 1000, "original/model.safetensors": b"\0" * 100,
             "inference/config.json": b"{}", ".gitattributes": b"*.safetensors filter=lfs\n"}
    h.main = h.add_dir(REPO, TINY, extra=extra)  # README.md comes along too
    h.v1 = h.add_dir(REPO, TINY, ref="v1", extra={**extra, "generation_config.json": GREEDY})
    h.add_dir("tiny/private", TINY, token=TOKEN)
    yield h
    h.close()


@pytest.fixture
def home(tmp_path: Path, hub: FakeHub) -> Path:
    hub.reset_records()
    hub.drop_at.clear()
    hub.corrupt.clear()
    return tmp_path / "hf"


def hub_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = env_for(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_HUB_OFFLINE="0")
    for k in ("HF_TOKEN", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_XET"):
        env.pop(k, None)
    env.update(extra)
    return env


def dsv4(home: Path, hub: FakeHub, *args: str, endpoint: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return run_dsv4(*args, env=hub_env(home, endpoint or hub.url, **env), timeout=120)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def repo_dir(home: Path, repo: str = REPO) -> Path:
    return home / "hub" / ("models--" + repo.replace("/", "--"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_then_run_local_from_the_cache_offline(home: Path, hub: FakeHub) -> None:
    r = dsv4(home, hub, "pull", REPO)
    assert r.returncode == 0, r.stderr
    snap = Path(r.stdout.strip())
    assert snap == repo_dir(home) / "snapshots" / hub.main
    assert sorted(p.name for p in snap.iterdir()) == PULLED  # no *.bin, README, original/, inference/
    for name in PULLED:
        assert (snap / name).is_symlink() and sha256(snap / name) == sha256(TINY / name)
    assert (repo_dir(home) / "refs" / "main").read_text() == hub.main
    assert dict(hub.served) == {p: (TINY / p).stat().st_size for p in PULLED}
    assert "pulled tiny/shakespeare@main" in r.stderr
    # the CDN (another origin) serves the weights, over plain HTTP although the hub offers Xet
    assert [p for m, p, _ in hub.requests if p.startswith("/cdn/")] == [f"/cdn/{sha256(TINY / 'model.safetensors')}"]

    hub.reset_records()
    r = dsv4(home, hub, "run", "--local", "--model", REPO, "--max-tokens", "8", "--temperature", "0",
             "--num-speculative-tokens", "0", "ROMEO:", HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    assert hub.requests == []  # offline: the snapshot came from the cache alone


def test_an_interrupted_pull_resumes_where_it_stopped(home: Path, hub: FakeHub) -> None:
    cut = 10_000_000
    hub.drop_at["model.safetensors"] = cut
    r = dsv4(home, hub, "pull", REPO)
    assert r.returncode == 1
    started, line = r.stderr.strip().splitlines()
    assert started.startswith(f"dsv4: pulling {REPO}: 28.2 MB to download") and "Traceback" not in r.stderr
    assert "model.safetensors: the download was interrupted at" in line and "run the pull again" in line
    blob = repo_dir(home) / "blobs" / sha256(TINY / "model.safetensors")
    assert Path(f"{blob}.incomplete").stat().st_size == cut and not blob.exists()
    assert hub.served["model.safetensors"] == cut  # the retries got nothing more
    r = dsv4(home, hub, "models", "--json")
    assert [row["missing"] for row in json.loads(r.stdout)] == [["model.safetensors"]]

    hub.drop_at.clear()
    hub.reset_records()
    r = dsv4(home, hub, "pull", REPO)
    assert r.returncode == 0, r.stderr
    assert dict(hub.served) == {"model.safetensors": WEIGHTS - cut}  # only the rest, nothing else again
    ranges = [h.get("range") for m, p, h in hub.requests if p.startswith("/cdn/")]
    assert ranges == [f"bytes={cut}-"]
    assert sha256(blob) == sha256(TINY / "model.safetensors") and not Path(f"{blob}.incomplete").exists()
    assert "kept from an interrupted pull" in r.stderr


def test_a_file_that_does_not_match_its_hash_is_refused(home: Path, hub: FakeHub) -> None:
    hub.corrupt.add("model.safetensors")
    r = dsv4(home, hub, "pull", REPO)
    assert r.returncode == 2
    started, line = r.stderr.strip().splitlines()
    assert started.startswith(f"dsv4: pulling {REPO}") and "Traceback" not in r.stderr
    assert line.startswith(f"dsv4: {REPO}@main: model.safetensors: sha256 ")
    assert f"does not match the hub's {sha256(TINY / 'model.safetensors')[:16]}" in line and "refused and removed" in line
    blobs = repo_dir(home) / "blobs"
    assert not any(p.name.startswith(sha256(TINY / "model.safetensors")) for p in blobs.iterdir())
    assert not (repo_dir(home) / "snapshots" / hub.main / "model.safetensors").exists()
    r = dsv4(home, hub, "run", "--local", "--model", REPO, "x", HF_HUB_OFFLINE="1")
    assert r.returncode == 2 and "is incomplete in the hub cache" in one_line(r.stderr)


def test_bad_names_and_no_hub_each_say_which(home: Path, hub: FakeHub) -> None:
    cases = [
        (("pull", "tiny/nope"), {}, f"no model repo tiny/nope on {hub.url} (HTTP 404)"),
        (("serve", "--model", "tiny/nope", "--socket", "ipc:///tmp/dsv4t-none/d.sock"), {},
         f"--model tiny/nope: no such directory, and no model repo tiny/nope on {hub.url} (HTTP 404)"),
        (("convert", "tiny/nope", "out"), {}, f"SRC tiny/nope: no such directory, and no model repo tiny/nope"),
        (("pull", REPO, "--revision", "nope"), {}, f"{REPO} has no revision 'nope' on {hub.url}"),
        (("pull", "tiny/na me"), {}, "'tiny/na me' is not a valid hub repo id"),
        (("run", "--local", "--model", "tiny/na me", "x"), {},
         "--model tiny/na me: no such directory, and 'tiny/na me' is not a valid hub repo id"),
        (("pull", REPO), {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 forbids downloading it"),
        (("serve", "--model", REPO, "--socket", "ipc:///tmp/dsv4t-none/d.sock"), {"HF_HUB_OFFLINE": "1"},
         "HF_HUB_OFFLINE=1 forbids downloading it"),
        (("pull", "tiny/private"), {}, f"no model repo tiny/private on {hub.url} (HTTP 401): check the name; "
                                       f"a private repo needs HF_TOKEN"),
    ]
    for args, env, words in cases:
        r = dsv4(home, hub, *args, **env)
        assert r.returncode == 2 and words in one_line(r.stderr), (args, r.stderr)
    assert not any(p.startswith("/cdn/") for _, p, _ in hub.requests)
    down = f"http://127.0.0.1:{free_port()}"
    r = dsv4(home, hub, "pull", REPO, endpoint=down)
    assert r.returncode == 2
    assert one_line(r.stderr) == (f"dsv4: cannot reach the hub at {down} (connection refused), and {REPO} is not in "
                                  f"the hub cache {home / 'hub'}")


def test_a_cached_model_is_used_when_the_hub_is_down(home: Path, hub: FakeHub) -> None:
    assert dsv4(home, hub, "pull", REPO).returncode == 0
    down = f"http://127.0.0.1:{free_port()}"
    r = dsv4(home, hub, "pull", REPO, endpoint=down)
    assert r.returncode == 0, r.stderr
    assert f"warning: cannot reach the hub at {down} (connection refused); using the cached {REPO}@main" in r.stderr
    assert r.stdout.strip().endswith(hub.main)


def test_revision_and_auto_download(home: Path, hub: FakeHub, tmp_path: Path) -> None:
    """--revision v1 pulls that commit; a command given --model ORG/NAME (draft-vocab here,
    serve and run --local alike) pulls what is missing itself, then uses the cache."""
    r = dsv4(home, hub, "pull", REPO, "--revision", "v1")
    assert r.returncode == 0, r.stderr
    v1 = Path(r.stdout.strip())
    assert v1.name == hub.v1 and (v1 / "generation_config.json").read_bytes() == GREEDY
    assert (repo_dir(home) / "refs" / "v1").read_text() == hub.v1
    text = tmp_path / "text.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 20)
    hub.reset_records()
    r = dsv4(home, hub, "draft-vocab", str(text), "--model", REPO, "--size", "64", "--out", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    assert "pulled tiny/shakespeare@main" in r.stderr
    assert dict(hub.served) == {"generation_config.json": 149}  # what main shares with v1 is linked, not fetched
    hub.reset_records()
    r = dsv4(home, hub, "draft-vocab", str(text), "--model", REPO, "--revision", "v1", "--size", "64", "--out",
             str(tmp_path / "d1.json"))
    assert r.returncode == 0, r.stderr
    assert not hub.served and [p for _, p, _ in hub.requests if "/api/models/" in p] == [
        f"/api/models/{REPO}/revision/v1"]  # complete: one question to the hub, nothing downloaded


def test_a_private_repo_with_hf_token(home: Path, hub: FakeHub) -> None:
    r = dsv4(home, hub, "pull", "tiny/private", HF_TOKEN=TOKEN)
    assert r.returncode == 0, r.stderr
    hub_side = [h for _, p, h in hub.requests if p.startswith(("/api/models/", "/tiny/"))]
    cdn_side = [h for _, p, h in hub.requests if p.startswith("/cdn/")]
    assert hub_side and all(h.get("authorization") == f"Bearer {TOKEN}" for h in hub_side)
    assert cdn_side and not any("authorization" in h for h in cdn_side)  # the token stays on the hub


def test_models_lists_the_cache(home: Path, hub: FakeHub) -> None:
    from safetensors import safe_open

    r = dsv4(home, hub, "models")
    assert r.returncode == 0 and r.stdout == "" and "no models in the hub cache" in r.stderr
    assert dsv4(home, hub, "pull", REPO).returncode == 0
    assert dsv4(home, hub, "pull", REPO, "--revision", "v1").returncode == 0
    r = dsv4(home, hub, "models")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["MODEL", "REVISION", "COMMIT", "SIZE", "FORMAT", "WEIGHTS", "FITS"]
    assert sorted(row.split()[1] for row in rows) == ["main", "v1"]
    assert all(row.split()[0] == REPO and row.split()[3:6] == ["28.2", "MB", "bf16"] for row in rows), rows
    assert all(row.split()[8] in ("yes", "no") for row in rows), rows
    data = json.loads(dsv4(home, hub, "models", "--json").stdout)
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).nbytes for k in f.keys())
    by_ref = {tuple(d["refs"]): d for d in data}
    main = by_ref[("main",)]
    assert main["commit"] == hub.main and main["format"] == "bf16" and main["servable"] and main["missing"] == []
    assert main["model_type"] == "deepseek_v4" and main["weight_bytes"] == stored
    assert main["size_on_disk"] == sum((TINY / p).stat().st_size for p in PULLED)
    assert isinstance(main["fits"], bool) and main["available_bytes"] > 0
    assert by_ref[("v1",)]["commit"] == hub.v1


def test_the_progress_bar_on_a_terminal(home: Path, hub: FakeHub) -> None:
    master, slave = pty.openpty()
    p = subprocess.Popen([*CMD, "pull", REPO], env=hub_env(home, hub.url), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(60) == 0
    text = out.decode(errors="replace")
    assert REPO in text and "/28.2 MB" in text and "eta" in text  # bytes of the total, time left
    assert "MB/s" in text or "kB/s" in text or "?" in text  # the speed (unknown until samples come)
    assert p.stdout.read().decode().strip().endswith(hub.main)


def test_the_cache_is_huggingface_hubs_own(home: Path, hub: FakeHub) -> None:
    """What huggingface_hub's snapshot_download (vLLM's way in) puts in the cache, dsv4 finds
    complete; what dsv4 pulls, huggingface_hub finds offline."""
    code = ("import sys; from huggingface_hub import snapshot_download as s; from dsv4.hub.cache import ALLOW_PATTERNS; "
            "print(s(sys.argv[1], allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=['*/*'], "
            "local_files_only=sys.argv[2] == '1'))")  # the files dsv4 pulls
    env = hub_env(home, hub.url, HF_HUB_DISABLE_XET="1")
    r = subprocess.run([sys.executable, "-c", code, REPO, "0"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    hub.reset_records()
    r2 = dsv4(home, hub, "pull", REPO)
    assert r2.returncode == 0 and r2.stdout.strip() == r.stdout.strip().splitlines()[-1], r2.stderr
    assert not hub.served and "is complete in the hub cache" in r2.stderr
    other = home.parent / "hf2"
    assert dsv4(other, hub, "pull", REPO).returncode == 0
    r = subprocess.run([sys.executable, "-c", code, REPO, "1"], env=hub_env(other, hub.url, HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]) == repo_dir(other) / "snapshots" / hub.main
