"""`--compile` (dsv4/engine/compile/compiled.py) on a small random checkpoint, fp32 on CPU.

* Compiled equals eager: greedy chains token for token with MTP K = 1, prompts across
  chunk boundaries (the verify and draft dispatches run captured; prefill chunks eager),
  and the captured dispatches actually ran, with the CPU's compile settings in effect
  (the C++ GEMM template, a cacheable program). One bucket of 1 + K tokens serves both the
  main model and the MTP (a 1-token draft dispatch pads up to it): with the production
  settings a cold capture of this model takes about a minute a bucket on a 2-core CI
  machine, which the suite cannot afford for every bucket. K = 2 (bucket 3 -> 4, drafts at
  two depths) runs with `DSV4_TEST_COMPILE_K=1,2 ./test.sh tests/model/test_compiled.py`
  when the compiled path changes. What compiles is the model's own forward_batch /
  mtp_forward on a static dispatch: tests/model/test_incremental.py
  `test_static_dispatch_equals_built` checks that dispatch uncompiled on every bucket shape
  (float32, w8a8), and test_fast_paths.py the traced-only pieces (Sinkhorn bit for bit, the
  gathered MoE). Two ranks compiling (the collectives in the graph) equal one eager process
  with `DSV4_TEST_COMPILE_TP=1` (four cold buckets a rank: minutes).
* Bad input: no C++ compiler (`CXX=/nonexistent`) gives one warning line and eager output.
* The compile cache is private: created 0700 under $XDG_CACHE_HOME/dsv4/inductor, and a
  directory another user could write is refused (eager, with the reason), and so is one
  below a directory another user could write (they could swap it after the check); the
  check runs again before each bucket's compile, and a failure stops the capture.

Compiling is the slow part (tens of seconds a bucket on a small CPU): the model is as
small as still covers a hash layer, a CSA layer with its indexer and the MTP block, and
the inductor cache lives in build/ (ignored by git), so later runs find it warm.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4 import LLM, SamplingParams
from dsv4.engine.compile.env import (CompileUnavailable, buckets, check_backend, private_cache_dir,
                                     recheck_cache_dir)
from tests.checkpoints import write_tiny_checkpoint
from tests.e2e.util import dsv4, env_for

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(num_hidden_layers=1, compress_ratios=[4, 0], hc_sinkhorn_iters=2, index_topk=3)


@pytest.fixture(scope="module")
def cache_home():
    d = ROOT / "build" / "test-cache"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(d)
    yield d
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    write_tiny_checkpoint(d, **SMALL)
    return d


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lengths]


COMPILE_KS = [int(k) for k in os.environ.get("DSV4_TEST_COMPILE_K", "1").split(",")]


@pytest.mark.parametrize("path", ["aoti", "torch.compile"])
@pytest.mark.parametrize("k", COMPILE_KS)
def test_compiled_greedy_equals_eager(ckpt, cache_home, k, path, monkeypatch):
    """Both ways a bucket compiles: an AOTInductor package (a CPU with one rank), and
    torch.compile, which is also where a bucket goes when its package cannot be built."""
    one = buckets(1 + k)[-1:]  # the one bucket every dispatch of this test fits (see the docstring)
    monkeypatch.setattr("dsv4.engine.compile.compiled.buckets", lambda max_tokens: list(one))
    if path == "torch.compile":
        def no_package(*args, **kwargs):
            raise RuntimeError("export failed (this test)")
        monkeypatch.setattr("dsv4.engine.compile.artifacts.obtain", no_package)
    try:
        check_backend(torch.device("cpu"))
    except CompileUnavailable as e:  # the fallback itself is test_no_compiler_falls_back_to_eager
        pytest.skip(f"inductor cannot compile on this machine: {e}")
    prompts = _prompts([1, 5, 37, 50, 300])  # 37 and 50 tokens: three and four chunks of 16
    prompts.append(prompts[-1] + prompts[2])  # one at a time: this one hits the 300's first block
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    kw = dict(max_num_seqs=1, max_model_len=400, prefill_limit=16, num_speculative_tokens=k)
    ref = [c.token_ids for c in LLM(ckpt, enable_prefix_caching=False, **kw).generate(prompts, sp)]
    counters.clear()
    llm = LLM(ckpt, compile=True, **kw)
    steps = llm.engine.runner.compiled
    assert steps is not None, llm.engine.compile_note
    assert "captured" in llm.engine.compile_note and not steps.failed
    if path == "torch.compile":
        # CPU_OPTIONS took effect (torch.compile(options=...) would silently leave freezing off):
        # matmuls ran through the C++ GEMM template, and every bucket could be cached
        inductor = counters["inductor"]
        assert inductor["cpp_templated_kernel_counter"] > 0, dict(inductor)
        assert inductor["fxgraph_cache_bypass"] == 0, dict(inductor)
        assert not steps.aot
    else:
        assert set(steps.aot) == {("main", one[0]), ("mtp", one[0])}
    assert steps.buckets == one and steps.ready == {("main", one[0]): True, ("mtp", one[0]): True}
    in_use = {"main": list(one), "mtp": list(one)}  # what status and each request's final report
    assert llm.engine.status()["compiled"] is True and llm.engine.compiled_buckets() == in_use
    done = llm.generate(prompts, sp)
    assert [c.token_ids for c in done] == ref
    assert all(c.metrics["compiled"] is True and c.metrics["compiled_buckets"] == in_use for c in done)
    assert steps.calls["main"] > 0 and steps.calls["mtp"] > 0
    assert llm.engine.scheduler.kv.hits == 256  # decoding compiled after a prefix-cache hit


@pytest.mark.skipif(os.environ.get("DSV4_TEST_COMPILE_TP") != "1",
                    reason="two ranks compiling four buckets cold cost minutes: DSV4_TEST_COMPILE_TP=1 runs it")
def test_compiled_two_ranks_equal_one_eager(ckpt, cache_home):
    """--compile at --tensor-parallel-size 2 (collectives inside the graph, both ranks capturing
    buckets 1 and 2 in step): greedy chains with MTP K = 1 equal one eager process's."""
    try:
        check_backend(torch.device("cpu"))
    except CompileUnavailable as e:
        pytest.skip(f"inductor cannot compile on this machine: {e}")
    prompts = _prompts([1, 5, 37])
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=1, max_model_len=128, prefill_limit=16, num_speculative_tokens=1)
    ref = [c.token_ids for c in LLM(ckpt, **kw).generate(prompts, sp)]
    with LLM(ckpt, compile=True, tensor_parallel_size=2, **kw) as llm:
        assert llm.engine.compiled_buckets() == {"main": [1, 2], "mtp": [1, 2]}, llm.engine.compile_note
        out = [c.token_ids for c in llm.generate(prompts, sp)]
        assert llm.engine.runner.compiled.calls["main"] > 0 and llm.engine.runner.compiled.calls["mtp"] > 0
    assert out == ref


def test_no_compiler_falls_back_to_eager(ckpt, cache_home):
    args = ("run", "--local", "--model", str(ckpt), "--max-tokens", "6", "--ignore-eos", "--raw",
            "--num-speculative-tokens", "1", "--json", "To be")
    ref = dsv4(*args, timeout=120)
    assert ref.returncode == 0, ref.stderr
    r = dsv4(*args, "--compile", timeout=120, env=env_for(CXX="/nonexistent", XDG_CACHE_HOME=str(cache_home)))
    assert r.returncode == 0, r.stderr
    out, want = json.loads(r.stdout), json.loads(ref.stdout)
    assert (out["text"], out["token_ids"]) == (want["text"], want["token_ids"])
    assert out["compiled"] is False and out["compiled_buckets"] == {"main": [], "mtp": []}  # --json says so
    warn = [line for line in r.stderr.splitlines() if "--compile" in line]
    assert len(warn) == 1 and "no C++ compiler" in warn[0] and "running eager" in warn[0], r.stderr


def test_cache_dir_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    d = private_cache_dir()
    assert d == tmp_path / "c" / "dsv4" / "inductor"
    for p in (d, d.parent):
        st = os.lstat(p)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(d)
    d.chmod(0o777)  # another user could plant compiled code here: refused
    with pytest.raises(CompileUnavailable, match="open to other users"):
        private_cache_dir()
    d.rmdir()
    (tmp_path / "elsewhere").mkdir()
    d.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CompileUnavailable, match="is a symlink"):
        private_cache_dir()


def test_cache_dir_below_a_shared_directory_refused_and_rechecked(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename our private directory away and put theirs in its place
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared / "c"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    with pytest.raises(CompileUnavailable, match=rf"^compile cache {shared}/c/dsv4/inductor: {shared} above it has "
                                                 r"mode 0777, writable by other users"):
        private_cache_dir()
    shared.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    d = private_cache_dir()
    recheck_cache_dir(d)
    shared.chmod(0o777)  # after the start: the check before the next bucket's compile sees it
    with pytest.raises(CompileUnavailable, match="writable by other users"):
        recheck_cache_dir(d)
    shared.chmod(0o700)
    d.rename(d.parent / "moved")  # a swapped directory: the checked one gone, another in its place
    d.symlink_to(d.parent / "moved")
    with pytest.raises(CompileUnavailable, match="is a symlink"):
        recheck_cache_dir(d)
    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.model.model import DeepseekV4, init_random
    from tests.model.tiny import tiny_config

    model = init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()
    steps = CompiledSteps(model, model.new_state(3, 64, max_chunk=8, max_spec=2), 4, with_mtp=False, cache_dir=d)
    steps.capture()  # refused before the first compile: nothing is compiled, every bucket eager
    assert steps.ready == {} and len(steps.failed) == 1 and "the capture stopped; 3 bucket(s) run eager" in steps.failed[0]


def test_unsafe_cache_dir_runs_eager(ckpt, tmp_path, monkeypatch):
    (tmp_path / "dsv4").mkdir(mode=0o777)
    (tmp_path / "dsv4").chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(ckpt, compile=True, max_num_seqs=1, max_model_len=64, num_speculative_tokens=0)
    assert llm.engine.runner.compiled is None
    note = llm.engine.compile_note
    assert note.startswith("compile: off (compile cache") and "other users" in note


def test_failed_capture_names_its_bucket_and_runs_eager():
    """A bucket whose capture raises is named in one line and left to eager; the others run
    captured (here the uncompiled program stands in for the compiled one: no compile time)."""
    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.model.model import DeepseekV4, init_random
    from dsv4.model.state import Batch
    from tests.model.tiny import tiny_config

    model = init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()
    state = model.new_state(3, 64, max_chunk=8, max_spec=2)
    steps = CompiledSteps(model, state, 4, with_mtp=False)
    steps.time_buckets = False  # a stand-in is no faster than eager (test_a_bucket_slower_than_eager_runs_eager)

    def main(ids, pos, slots):
        if ids.shape[0] == 2:
            raise RuntimeError("C++ compile error\nmore")
        return steps._main_step(ids, pos, slots)

    steps._main = main
    steps.capture()
    assert steps.ready == {("main", 1): True, ("main", 4): True}
    assert len(steps.failed) == 1
    assert "main bucket of 2 tokens failed (RuntimeError: C++ compile error)" in steps.failed[0]
    with torch.inference_mode():
        assert steps.main(Batch.build([(0, 0, [5, 6])]), None) is None  # bucket 2: the caller runs eager
        assert state.lengths[0] == 0
        h, logits = steps.main(Batch.build([(0, 0, [5, 6, 7])]), None)  # 3 tokens padded into bucket 4
    assert h.shape[0] == 3 and logits.shape[0] == 3 and state.lengths[:2] == [3, 0]
    assert steps.calls["main"] == 1


def test_a_bucket_slower_than_eager_runs_eager(caplog):
    """Each captured bucket is timed against eager on a scratch dispatch (`bucket_check`) and
    kept only where it is not slower (here a stand-in program that sleeps: no compile time)."""
    import logging
    import time

    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.model.model import DeepseekV4, init_random
    from dsv4.model.state import Batch
    from tests.model.tiny import tiny_config

    model = init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()
    state = model.new_state(3, 64, max_chunk=8, max_spec=2)
    steps = CompiledSteps(model, state, 2, with_mtp=False)

    with torch.inference_mode():
        one = steps._main_step(*steps._padded(None, 1))  # bucket 1's stand-in returns this at once

    def main(ids, pos, slots):
        if ids.shape[0] == 1:
            return one  # faster than any eager step
        time.sleep(0.05)  # far slower than an eager step of this model
        return steps._main_step(ids, pos, slots)

    steps._main = main
    with caplog.at_level(logging.WARNING, logger="dsv4.compile"):
        steps.capture()
    assert steps.ready == {("main", 1): True, ("main", 2): False} and steps.slower == {("main", 2)}
    assert steps.missing() == [] and steps.in_use() == {"main": [1], "mtp": []}
    assert any("the main bucket of 2 tokens runs eager: compiled" in r.getMessage() for r in caplog.records)
    with torch.inference_mode():
        assert steps.main(Batch.build([(0, 0, [5, 6])]), None) is None  # the caller runs eager


def test_a_context_past_the_compiled_span_runs_eager():
    """A compiled step attends over `state.static_len` positions (2048 at most, its masks span
    them all); a decode row past them goes to eager, whose cost follows the context."""
    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.model.model import DeepseekV4, init_random
    from dsv4.model.state import Batch
    from tests.model.tiny import tiny_config

    model = init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()
    state = model.new_state(2, 4096, max_chunk=8, max_spec=2)
    assert state.static_len == 2048 and model.new_state(2, 300).static_len == 300
    steps = CompiledSteps(model, state, 2, with_mtp=False, cache_dir=None)
    steps.ready[("main", 1)] = steps.ready[("main", 2)] = True  # as if captured
    assert steps._bucket("main", Batch.build([(0, 100, [5])])) == 1
    assert steps._bucket("main", Batch.build([(0, 2046, [5, 6])])) == 2
    assert steps._bucket("main", Batch.build([(0, 2047, [5, 6])])) is None
    assert steps._bucket("main", Batch.build([(0, 5, [5]), (1, 3000, [6])])) is None
