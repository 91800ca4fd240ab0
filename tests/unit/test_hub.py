"""Models by name (dsv4.hub), without the network: repo ids, which files are pulled, how a
--model resolves through a hub cache laid out by hand, what `dsv4 models` reads of a
snapshot, and the engine config of a cached hub model (its --revision included)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

import dsv4
from dsv4.hub import cache as C
from dsv4.hub import listing as L

TINY = Path(dsv4.DEFAULT_MODEL)


def commit_for(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def put_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], ref: str | None = "main",
                 listing: dict[str, bytes] | None = None) -> Path:
    """A snapshot in huggingface_hub's layout: blobs named by hash, relative links, a ref and
    (with `listing`) the repo's tree listing."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit_for(repo_id + json.dumps(sorted(files)) + str(ref))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    if listing is not None:
        C.write_listing(root, commit, {p: {"size": len(d), "blob_id": "0" * 40} for p, d in listing.items()})
    return snap


def tiny_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in TINY.iterdir() if p.is_file() and p.name != "README.md"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that huggingface_hub's constants point at (read at its import, so
    patched here), online."""
    from huggingface_hub import constants

    d = tmp_path / "hub"
    d.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(d))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return d


@pytest.mark.parametrize("text, looks, valid", [
    ("deepseek-ai/DeepSeek-V4-Flash", True, True),
    ("org/name.v2_b", True, True),
    ("a/b", True, True),
    ("org/na me", True, False),
    ("org/-name", True, False),
    ("org/na--me", True, False),
    ("org/na..me", True, False),
    ("org/name.git", True, False),
    ("o/" + "x" * 95, True, False),
    ("./org/name", False, False),
    ("/abs/path", False, False),
    ("~/models/x", False, False),
    ("a/b/c", False, False),
    ("name", False, False),
    ("org/", False, False),
])
def test_repo_ids(text: str, looks: bool, valid: bool) -> None:
    assert C.looks_like_repo_id(text) is looks
    if valid:
        assert C.check_repo_id(text) == text
    else:
        with pytest.raises(C.HubError, match="not a valid hub repo id") as e:
            C.check_repo_id(text)
        assert e.value.code == 2


@pytest.mark.parametrize("path, pulled", [
    ("config.json", True), ("generation_config.json", True), ("tokenizer.json", True),
    ("tokenizer_config.json", True), ("model.safetensors", True), ("model-00001-of-00046.safetensors", True),
    ("model.safetensors.index.json", True), ("draft_vocab.json", True),
    ("pytorch_model.bin", False), ("consolidated.pt", False), ("original/model.safetensors", False),
    ("inference/config.json", False), ("README.md", False), (".gitattributes", False), ("vocab.txt", False),
])
def test_only_what_dsv4_reads_is_pulled(path: str, pulled: bool) -> None:
    assert C.wanted(path) is pulled


def test_a_cached_repo_resolves_without_the_network(cache: Path) -> None:
    snap = put_snapshot(cache, "org/tiny", tiny_files())
    path, found = C.resolve_model("org/tiny")
    assert path == snap and found is not None
    assert (found.repo_id, found.revision, found.commit) == ("org/tiny", "main", snap.name)
    assert C.resolve_model("org/tiny", snap.name)[0] == snap  # a commit resolves as itself
    with pytest.raises(C.HubError, match=r"org/tiny at revision v9 is not in the hub cache .*'dsv4 pull org/tiny "
                                         r"--revision v9' downloads it"):
        C.resolve_model("org/tiny", "v9")


def test_a_local_directory_wins_over_the_cache(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put_snapshot(cache, "org/tiny", tiny_files())
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    path, snap = C.resolve_model("org/tiny")
    assert path == Path("org/tiny") and snap is None
    with pytest.raises(C.HubError, match="is a local directory, which has no revisions"):
        C.resolve_model("org/tiny", "main")


def test_missing_names_say_which(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    with pytest.raises(C.HubError, match=r"^--model /no/such/dir: no such directory$"):
        C.resolve_model("/no/such/dir")
    with pytest.raises(C.HubError, match=r"--model org/na me: no such directory, and 'org/na me' is not a valid"):
        C.resolve_model("org/na me")
    with pytest.raises(C.HubError, match=r"--model org/absent: no such directory, and org/absent is not in the "
                                         r"hub cache .*; 'dsv4 pull org/absent' downloads it"):
        C.resolve_model("org/absent")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(C.HubError, match="HF_HUB_OFFLINE=1 forbids downloading it"):
        C.resolve_model("org/absent")


def test_an_incomplete_snapshot_is_refused_by_its_listing(cache: Path) -> None:
    files = tiny_files()
    present = {k: v for k, v in files.items() if k != "model.safetensors"}
    put_snapshot(cache, "org/half", present, listing={**files, "README.md": b"", "original/x.safetensors": b""})
    with pytest.raises(C.HubError, match=r"org/half is incomplete in the hub cache .* 1 file\(s\) missing "
                                         r"\(model\.safetensors\); 'dsv4 pull org/half' finishes it") as e:
        C.resolve_model("org/half")
    assert e.value.code == 2


def test_without_a_listing_the_index_names_the_shards(cache: Path) -> None:
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}).encode()
    put_snapshot(cache, "org/sharded", {"config.json": b"{}", "model.safetensors.index.json": index,
                                        "model-00001-of-00002.safetensors": b"x"})
    with pytest.raises(C.HubError, match=r"missing \(model-00002-of-00002\.safetensors\)"):
        C.resolve_model("org/sharded")


def test_engine_config_of_a_hub_model_and_its_revision(cache: Path) -> None:
    """--model ORG/NAME --revision REV: the engine reads that snapshot (here v1's own
    generation_config.json), names the model by its id, and stays valid when rebuilt."""
    from dsv4.engine.config import EngineConfig

    files = tiny_files()
    main = put_snapshot(cache, "org/tiny", files)
    v1 = put_snapshot(cache, "org/tiny", {**files, "generation_config.json": b'{"do_sample": false}'}, ref="v1")
    c = EngineConfig.create(model="org/tiny", num_speculative_tokens=0)
    assert (c.model, c.model_id, c.revision) == (str(main), "org/tiny", main.name)
    assert c.sampling_defaults["temperature"] == 0.8 and c.served_model_name == "org/tiny"
    c1 = EngineConfig.create(model="org/tiny", revision="v1", num_speculative_tokens=0)
    assert (c1.model, c1.revision) == (str(v1), v1.name)
    assert c1.sampling_defaults == {"temperature": 0.0}
    again = dataclasses.replace(c1, seed=1)  # rebuilt from its own fields: the snapshot, pinned to its commit
    assert (again.model, again.model_id, again.revision) == (c1.model, "org/tiny", v1.name)
    plain = EngineConfig.create(model=str(TINY), num_speculative_tokens=0)
    assert plain.model_id is None and plain.revision is None and plain.served_model_name == TINY.name


def test_engine_config_refuses_a_missing_hub_model(cache: Path) -> None:
    from dsv4.engine.config import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match="org/absent is not in the hub cache"):
        EngineConfig.create(model="org/absent")
    with pytest.raises(EngineConfigError, match="is a local directory, which has no revisions"):
        EngineConfig.create(model=str(TINY), revision="main")


# ---------------------------------------------------------------------------- dsv4 models
def safetensors_bytes(tensors: dict[str, tuple[str, list[int], int]]) -> bytes:
    """A safetensors file of zeros: name -> (dtype, shape, bytes per element)."""
    header, off = {}, 0
    for name, (dtype, shape, width) in tensors.items():
        n = width
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(off)


OFFICIAL = {"layers.0.attn.wq_a.weight": ("F8_E4M3", [256, 256], 1), "layers.0.attn.wq_a.scale": ("F8_E8M0", [2, 2], 1),
            "layers.0.ffn.experts.0.w1.weight": ("I8", [256, 128], 1),
            "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", [256, 8], 1), "embed.weight": ("BF16", [64, 256], 2)}
W8A8 = {"layers.0.attn.wq_a.weight": ("I8", [256, 256], 1), "layers.0.attn.wq_a.scale": ("F32", [256], 4),
        "embed.weight": ("BF16", [64, 256], 2)}


@pytest.mark.parametrize("config, tensors, fmt", [
    ({}, OFFICIAL, "FP8/FP4 (official)"),
    ({"dsv4_quantization": "w8a8"}, W8A8, "w8a8 (dsv4 convert)"),
    ({}, {"embed.weight": ("BF16", [64, 256], 2), "norm.weight": ("F32", [256], 4)}, "bf16"),
    ({}, {"embed.weight": ("F32", [64, 256], 4)}, "fp32"),
])
def test_weight_format_and_bytes_from_the_headers(tmp_path: Path, config: dict, tensors: dict, fmt: str) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(safetensors_bytes(tensors))
    dtypes = L.safetensors_dtype_bytes([f])
    assert L.weight_format(config, dtypes) == fmt
    expected = sum(w * __import__("math").prod(shape) for _, shape, w in tensors.values())
    assert sum(dtypes.values()) == expected == f.stat().st_size - 8 - struct.unpack("<Q", f.read_bytes()[:8])[0]


def test_fit_is_the_stored_bytes_against_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "available_memory", lambda: 10_000)
    assert L.weights_fit(9_999)[:2] == (True, 10_000)
    assert L.weights_fit(10_001)[:2] == (False, 10_000)
    monkeypatch.setattr(L, "available_memory", lambda: None)
    assert L.weights_fit(1)[0] is None


def test_cached_models_lists_every_snapshot(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "available_memory", lambda: 10**12)
    files = tiny_files()
    main = put_snapshot(cache, "org/tiny", files)
    put_snapshot(cache, "org/tiny", {**files, "generation_config.json": b"{}"}, ref="v1")
    half = put_snapshot(cache, "org/half", {"config.json": files["config.json"]}, listing=files)
    put_snapshot(cache, "other/llama", {"config.json": b'{"model_type": "llama"}',
                                        "model.safetensors": safetensors_bytes({"w": ("F16", [4], 2)})})
    (cache / "models--org--tiny" / "blobs" / "deadbeef.incomplete").write_bytes(b"partial")  # not a snapshot file
    rows = {(r.repo_id, tuple(r.refs)): r for r in L.cached_models(cache)}
    assert set(rows) == {("org/tiny", ("main",)), ("org/tiny", ("v1",)), ("org/half", ("main",)),
                         ("other/llama", ("main",))}
    tiny = rows[("org/tiny", ("main",))]
    weights = L.safetensors_dtype_bytes([TINY / "model.safetensors"])
    assert tiny.path == str(main) and tiny.commit == main.name and tiny.servable
    assert tiny.size_on_disk == sum(len(v) for v in files.values())
    assert tiny.format == "bf16" and tiny.weight_bytes == sum(weights.values()) and tiny.fits is True
    h = rows[("org/half", ("main",))]
    assert h.missing == sorted(set(files) - {"config.json"}) and not h.servable and h.fits is None
    assert half.name == h.commit
    llama = rows[("other/llama", ("main",))]
    assert llama.model_type == "llama" and llama.format == "fp16" and not llama.servable and llama.fits is None
    assert json.loads(json.dumps(tiny.as_json()))["servable"] is True
    assert L.cached_models(cache / "nothing-here") == []


# ---------------------------------------------------------------------------- the CLI's side
def test_fetch_model_pulls_then_pins_the_commit(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's --model ORG/NAME is pulled, then pinned to its commit: the engine, a
    detached daemon (its argv) and the other ranks resolve that snapshot without the network."""
    from huggingface_hub import constants

    from dsv4.cli import options as O
    from dsv4.cli.hub import fetch_model
    from tests.hubserver import FakeHub

    hub = FakeHub()
    try:
        commit = hub.add_dir("org/tiny", TINY)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        kw = O.engine_kwargs(model="org/tiny", num_speculative_tokens="0")
        fetch_model(kw)
        assert kw["revision"] == commit
        argv = O.engine_argv(kw)
        assert argv[argv.index("--model") + 1] == "org/tiny" and argv[argv.index("--revision") + 1] == commit
        hub.reset_records()
        fetch_model(kw)  # pinned to a complete commit: not a request
        assert hub.requests == []
        config = O.build_config(kw)
        assert (config.model_id, config.revision, Path(config.model).name) == ("org/tiny", commit, commit)
        local = O.engine_kwargs(model=str(TINY))
        fetch_model(local)  # a directory: untouched
        assert "revision" not in local and hub.requests == []
    finally:
        hub.close()


def test_status_names_a_hub_model_by_its_id() -> None:
    from dsv4.cli.status_view import status_lines

    st = {"model": "/c/models--org--tiny/snapshots/" + "a" * 40, "model_id": "org/tiny", "revision": "a" * 40}
    line = next(x for x in status_lines(st) if x.startswith("model "))
    assert f"org/tiny@{'a' * 12} (/c/models--org--tiny/snapshots/" in line
    assert not any(x.startswith(("model_id", "revision")) for x in status_lines(st))
