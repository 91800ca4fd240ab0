"""--compile's AOTInductor packages (dsv4/engine/compile/artifacts.py) on the 1-layer SMALL model.

One package is built (the main bucket of 1 token, ~20-40 s on a 2-core machine) and
reused by every case: a warm start through `CompiledSteps.capture` loads it (no
torch.compile) and gives eager's logits while writing the caller's state; a truncated
package, one whose metadata names another torch or CPU, and one that another user could
write (or owns) are refused with one warning line and rebuilt (the rebuild is stubbed with
a copy of the good package: its cost is the first build's).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from dsv4.engine.compile import artifacts
from dsv4.engine.compile.env import CompileUnavailable, check_backend, private_cache_dir
from dsv4.engine.compile.compiled import CompiledSteps
from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.state import Batch
from tests.model.tiny import tiny_config

SMALL = dict(num_hidden_layers=1, compress_ratios=[4, 0], hc_sinkhorn_iters=2, index_topk=3)


def _model() -> DeepseekV4:
    return init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()


def _state(model: DeepseekV4):
    return model.new_state(3, 64, max_chunk=8, max_spec=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(model, cache dir, package path, a pristine copy of it): built once."""
    try:
        check_backend(torch.device("cpu"))
    except CompileUnavailable as e:
        pytest.skip(f"inductor cannot compile on this machine: {e}")
    home = tmp_path_factory.mktemp("xdg")
    old = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["XDG_CACHE_HOME"] = str(home)
    cache = private_cache_dir()
    model = _model()
    state = _state(model)
    steps = CompiledSteps(model, state, 1, with_mtp=False, cache_dir=cache)  # grows the RoPE tables
    loaded, was_built = artifacts.obtain(model, state, "main", 1, steps.scratch, cache)
    assert was_built
    key = artifacts.artifact_key(model, state, "main", 1)
    path = cache / "aoti" / f"{key}.pt2"
    assert path.is_file() and (path.parent / (path.name + ".sha256")).is_file()
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    pristine = tmp_path_factory.mktemp("pristine") / path.name
    shutil.copy(path, pristine)
    yield model, cache, path, pristine
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def rebuilds(built, monkeypatch):
    """`artifacts.build` replaced by a copy of the pristine package; the calls are listed."""
    _, _, path, pristine = built
    calls: list[str] = []

    def fake_build(step, n, scratch, dest, key):
        calls.append(key)
        shutil.copy(pristine, dest)
        (dest.parent / (dest.name + ".sha256")).write_text(artifacts._sha256(pristine))

    monkeypatch.setattr(artifacts, "build", fake_build)
    yield calls
    path.unlink(missing_ok=True)  # the next case starts from the good package, ours and 0600
    fake_build(None, 1, 0, path, "")
    os.chmod(path, 0o600)


def test_warm_start_loads_and_equals_eager(built):
    model, cache, path, _ = built
    state = _state(model)
    steps = CompiledSteps(model, state, 1, with_mtp=False, cache_dir=cache)
    torch._dynamo.reset()
    steps.capture()
    assert steps.ready == {("main", 1): True} and not steps.failed
    assert ("main", 1) in steps.aot and steps.aot_built == []  # loaded, not built, not torch.compile'd
    ref = _state(model)
    before = [t.clone() for t in state.tensors()]
    with torch.inference_mode():
        for p, tok in enumerate([5, 17, 99, 3, 64, 7]):
            h1, l1 = model.forward_batch(Batch.build([(0, p, [tok])]), ref)
            h2, l2 = steps.main(Batch.build([(0, p, [tok])]), None)
            torch.testing.assert_close(l2, l1, atol=1e-5, rtol=0)
            torch.testing.assert_close(h2, h1, atol=1e-5, rtol=0)
    assert steps.calls["main"] == 6 and state.lengths[0] == 6
    assert any(not torch.equal(a, b) for a, b in zip(before, state.tensors()))  # the caller's state was written
    want, got = ref.snapshot(0), state.snapshot(0)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0)


def _obtain(model, cache):
    return artifacts.obtain(model, _state(model), "main", 1, 2, cache)


def _warned(caplog, reason: str) -> None:
    lines = [r.getMessage() for r in caplog.records if r.name == "dsv4.compile" and r.levelno == logging.WARNING]
    assert len(lines) == 1 and reason in lines[0] and "rebuilding" in lines[0], lines
    assert "\n" not in lines[0]


def test_truncated_package_is_rebuilt(built, rebuilds, caplog):
    model, cache, path, _ = built
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    _, was_built = _obtain(model, cache)  # the checksum refuses it before the loader sees it
    assert was_built and len(rebuilds) == 1
    _warned(caplog, "checksum does not match")


def test_flipped_byte_is_rebuilt(built, rebuilds, caplog):
    model, cache, path, _ = built
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the shared object
    path.write_bytes(bytes(data))
    assert _obtain(model, cache)[1] and len(rebuilds) == 1
    _warned(caplog, "checksum does not match")


@pytest.mark.parametrize("what", ["torch", "isa"])
def test_other_torch_or_cpu_is_rebuilt(built, rebuilds, caplog, monkeypatch, what):
    """A package under this process's key whose metadata names another torch or CPU ISA
    (the key hashes both, so this takes a renamed file: the metadata is checked anyway)."""
    model, cache, path, _ = built
    key = path.stem
    monkeypatch.setattr(artifacts, "artifact_key", lambda *a, **k: key)
    if what == "torch":
        monkeypatch.setattr(torch, "__version__", "9.9.9")
    else:
        monkeypatch.setattr(artifacts, "cpu_isa", lambda: "VecAVX2:avx2")
    fake = artifacts.build

    def build_here(*args):  # the rebuild happens on this torch and CPU again (and is stubbed)
        fake(*args)
        monkeypatch.undo()

    monkeypatch.setattr(artifacts, "build", build_here)
    assert _obtain(model, cache)[1] and len(rebuilds) == 1
    _warned(caplog, "was built for torch '2" if what == "torch" else "was built for isa 'Vec")


def test_group_writable_package_is_refused(built, rebuilds, caplog):
    model, cache, path, _ = built
    os.chmod(path, 0o664)
    assert _obtain(model, cache)[1] and len(rebuilds) == 1
    _warned(caplog, "writable by other users")


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_foreign_owned_package_is_refused(built, rebuilds, caplog):
    model, cache, path, _ = built
    os.chown(path, 65534, 65534)  # nobody
    assert _obtain(model, cache)[1] and len(rebuilds) == 1
    _warned(caplog, "belongs to uid 65534")


def test_unsafe_artifact_dir_is_refused(built):
    model, cache, _, _ = built
    d = cache / "aoti"
    d.chmod(0o770)
    try:
        with pytest.raises(artifacts.ArtifactError, match="open to other users"):
            _obtain(model, cache)  # CompiledSteps then compiles the bucket with torch.compile
    finally:
        d.chmod(0o700)


def test_key_covers_code_torch_isa_and_shapes(built, monkeypatch):
    model, _, path, _ = built
    state = _state(model)
    key = artifacts.artifact_key(model, state, "main", 1)
    assert key == path.stem
    assert artifacts.artifact_key(model, state, "main", 2) != key
    assert artifacts.artifact_key(model, state, "mtp", 1) != key
    assert artifacts.artifact_key(model, model.new_state(4, 64, max_chunk=8, max_spec=2), "main", 1) != key
    monkeypatch.setattr(artifacts, "_source_hash", lambda: "changed")
    assert artifacts.artifact_key(model, state, "main", 1) != key
    monkeypatch.undo()
    monkeypatch.setattr(artifacts, "cpu_isa", lambda: "VecAVX2:avx2")
    assert artifacts.artifact_key(model, state, "main", 1) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert artifacts.artifact_key(model, state, "main", 1) != key
    monkeypatch.undo()
    bf16 = _model().to(torch.bfloat16)
    assert artifacts.model_signature(bf16) != artifacts.model_signature(model)
