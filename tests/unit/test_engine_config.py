"""EngineConfig: defaults resolved from the checkpoint, every validation error names its flag,
and validation reads config.json and safetensors headers only."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch

from dsv4.config import block_entry_bytes
from safetensors.torch import save_file

from dsv4.engine.checks import free_memory
from dsv4.engine.config import DEFAULT_CHUNK, EngineConfig, EngineConfigError, resolve_prefill_limit

TINY = {
    "model_type": "deepseek_v4",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "o_groups": 1,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 0],
    "index_head_dim": 16,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 8192,
    "num_nextn_predict_layers": 1,
}


def make_ckpt(path: Path, mtp_layers: int = 1, mtp_tensors: bool = True, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY, num_nextn_predict_layers=mtp_layers, **overrides)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {"embed.weight": torch.zeros(4, 2)}
    if mtp_tensors:
        tensors["mtp.0.enorm.weight"] = torch.ones(2)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_ckpt(tmp_path / "ckpt")


def err(match_fn, **kw) -> str:
    with pytest.raises(EngineConfigError) as e:
        match_fn(**kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_resolved(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt))
    assert c.has_mtp and c.speculative_auto and c.num_speculative_tokens == 3  # auto: K in 0..3
    assert c.dtype == "float32" and c.device == "cpu"
    # CPU: no kernel tile; the chunk is DEFAULT_CHUNK (the NPU kernel's 128 is the model's tile)
    assert c.kernel_tile is None and c.prefill_limit == DEFAULT_CHUNK == 512 and c.model_config.prefill_limit == 128
    assert c.max_model_len == c.model_config.max_position_embeddings  # the model's whole context
    one = -(-(c.max_model_len + 3 + 1) // c.block_size)  # blocks of one request (K = 3 drafts + 1)
    assert c.block_size == 256 and c.kv_cache_blocks == 8 * one  # max_num_seqs requests at max_model_len
    assert c.kv_cache_memory == c.kv_cache_blocks * block_entry_bytes(c.model_config, 256, 4)
    assert any("prefix caching on" in s for s in c.banner_lines())
    assert c.max_num_batched_tokens == 512 + 8 * 4
    assert c.effective_chunk_size == 512 and not c.single_dispatch
    assert c.torch_dtype is torch.float32
    assert any("chunked prefill with speculative decoding: supported" in s for s in c.banner_lines())
    # replace() re-validates from resolved values
    c2 = dataclasses.replace(c, long_prefill_token_threshold=64)
    assert c2.effective_chunk_size == 64 and c2.has_mtp and c2.speculative_auto


def test_no_mtp_defaults_to_k0(tmp_path: Path) -> None:
    c = EngineConfig.create(model=str(make_ckpt(tmp_path / "a", mtp_layers=0)))
    assert not c.has_mtp and c.num_speculative_tokens == 0 and c.mtp_depth == 0
    c = EngineConfig.create(model=str(make_ckpt(tmp_path / "b", mtp_tensors=False)))
    assert not c.has_mtp and c.num_speculative_tokens == 0


def test_max_model_len_default_capped_by_positions(tmp_path: Path) -> None:
    c = EngineConfig.create(model=str(make_ckpt(tmp_path / "a", max_position_embeddings=300)))
    assert c.max_model_len == 300


def test_single_dispatch_exact_message(ckpt: Path) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), enable_chunked_prefill=False, max_model_len=4096)
    assert msg == ("chunked prefill is disabled, but max_model_len 4096 exceeds the single-dispatch prefill "
                   "limit 512 (--max-num-batched-tokens); enable chunked prefill, raise --max-num-batched-tokens "
                   "or lower --max-model-len to 512")


def test_single_dispatch_limit_from_budget(ckpt: Path) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), enable_chunked_prefill=False, max_model_len=128,
              max_num_batched_tokens=64)
    assert "single-dispatch prefill limit 64" in msg and "--max-num-batched-tokens" in msg
    assert "--max-model-len to 64" in msg


def test_single_dispatch_ok(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt), enable_chunked_prefill=False)
    assert c.single_dispatch and c.max_model_len == 512 and c.effective_chunk_size == 512
    c = EngineConfig.create(model=str(ckpt), enable_chunked_prefill=False, max_model_len=100,
                            long_prefill_token_threshold=16)
    assert c.effective_chunk_size == 100  # max_model_len; the threshold only applies when chunking


def test_chunk_size_threshold_and_budget(ckpt: Path) -> None:
    assert EngineConfig.create(model=str(ckpt), long_prefill_token_threshold=64).effective_chunk_size == 64
    assert EngineConfig.create(model=str(ckpt), max_num_batched_tokens=32).effective_chunk_size == 32
    assert EngineConfig.create(model=str(ckpt), prefill_limit=16).effective_chunk_size == 16


def test_k_without_mtp(tmp_path: Path) -> None:
    msg = err(EngineConfig.create, model=str(make_ckpt(tmp_path / "a", mtp_layers=0)), num_speculative_tokens=1)
    assert "--num-speculative-tokens 0" in msg and "num_nextn_predict_layers is 0" in msg
    msg = err(EngineConfig.create, model=str(make_ckpt(tmp_path / "b", mtp_tensors=False)), num_speculative_tokens=2)
    assert "--num-speculative-tokens 0" in msg and "mtp.0.*" in msg


@pytest.mark.parametrize("k", [-1, 4, 7])
def test_k_out_of_range(ckpt: Path, k: int) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), num_speculative_tokens=k)
    assert "--num-speculative-tokens" in msg


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_k_in_range(ckpt: Path, k: int) -> None:
    assert EngineConfig.create(model=str(ckpt), num_speculative_tokens=k).num_speculative_tokens == k


def test_budget_smaller_than_decode_step(ckpt: Path) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), num_speculative_tokens=3, max_num_batched_tokens=3)
    assert "--max-num-batched-tokens 3" in msg and "1 + K = 4" in msg and "--num-speculative-tokens" in msg
    assert EngineConfig.create(model=str(ckpt), num_speculative_tokens=3, max_num_batched_tokens=4)


def test_max_model_len_beyond_positions(ckpt: Path) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), max_model_len=9000)
    assert msg == "--max-model-len 9000 exceeds the model's max_position_embeddings 8192; lower --max-model-len to 8192"


@pytest.mark.parametrize("field,flag,value", [
    ("max_num_seqs", "--max-num-seqs", 0),
    ("max_num_seqs", "--max-num-seqs", True),
    ("max_model_len", "--max-model-len", 1),
    ("max_num_batched_tokens", "--max-num-batched-tokens", 0),
    ("long_prefill_token_threshold", "--long-prefill-token-threshold", -1),
    ("seed", "--seed", -3),
    ("seed", "--seed", "7"),
    ("dtype", "--dtype", "int8"),
    ("device", "--device", "tpu"),
    ("device", "--device", "cpu:1"),
    ("enable_chunked_prefill", "--enable-chunked-prefill", "yes"),
    ("prefill_limit", "prefill_limit", 0),
])
def test_bad_values_name_flag(ckpt: Path, field: str, flag: str, value) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), **{field: value})
    assert msg.startswith(flag), msg


def test_prefill_limit_may_only_be_lowered_under_a_kernel_tile(ckpt: Path) -> None:
    """The NPU kernel's tile (128) caps the chunk there; CPU and CUDA have none, so the chunk
    follows the step budget (issue 40)."""
    msg = err(resolve_prefill_limit, limit=256, budget=None, tile=128, device="npu")
    assert "prefill_limit 256 exceeds the prefill limit 128 of deepseek_v4 on npu" in msg and "only be lowered" in msg
    assert resolve_prefill_limit(None, 2048, 128, "npu") == 128  # a budget never raises the tile
    assert resolve_prefill_limit(None, None, None, "cpu") == DEFAULT_CHUNK
    assert resolve_prefill_limit(None, 2048, None, "cpu") == 2048  # the budget is the chunk
    c = EngineConfig.create(model=str(ckpt), prefill_limit=256)
    assert c.effective_chunk_size == 256 and c.kernel_tile is None


def test_a_budget_larger_than_a_step_can_use_is_refused(ckpt: Path) -> None:
    """A step carries at most every slot's longest row (a whole prompt, or a decode row)."""
    c = EngineConfig.create(model=str(ckpt), max_model_len=256, max_num_seqs=2, num_speculative_tokens=1,
                            max_num_batched_tokens=516)
    assert c.effective_chunk_size == 256 and c.max_num_batched_tokens == 516  # the chunk: at most max_model_len
    msg = err(EngineConfig.create, model=str(ckpt), max_model_len=256, max_num_seqs=2, num_speculative_tokens=1,
              max_num_batched_tokens=517)
    assert msg.startswith("--max-num-batched-tokens 517 is more than a step can use") and "to 516" in msg
    small = EngineConfig.create(model=str(ckpt), max_model_len=64, max_num_seqs=1)  # the default chunk is 512
    assert dataclasses.replace(small, seed=1).max_num_batched_tokens == small.max_num_batched_tokens


def test_dtype_resolution(ckpt: Path) -> None:
    assert EngineConfig.create(model=str(ckpt), dtype="bfloat16").dtype == "bfloat16"
    assert EngineConfig.create(model=str(ckpt), dtype="float16").torch_dtype is torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable(ckpt: Path) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), device="cuda:0")
    assert msg.startswith("--device cuda:0") and "--device cpu" in msg


def test_npu_without_torch_npu(ckpt: Path) -> None:
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    msg = err(EngineConfig.create, model=str(ckpt), device="npu")
    assert msg.startswith("--device npu") and "torch_npu" in msg


def test_missing_model(tmp_path: Path) -> None:
    assert err(EngineConfig.create, model=str(tmp_path / "nope")).startswith("--model ")
    (tmp_path / "empty").mkdir()
    msg = err(EngineConfig.create, model=str(tmp_path / "empty"))
    assert msg.startswith("--model ") and "config.json" in msg
    (tmp_path / "f").write_text("x")
    assert err(EngineConfig.create, model=str(tmp_path / "f")).startswith("--model ")


def test_bad_config_json_wrapped(tmp_path: Path) -> None:
    make_ckpt(tmp_path / "a", model_type="llama")
    msg = err(EngineConfig.create, model=str(tmp_path / "a"))
    assert msg.startswith("--model ") and "model_type" in msg
    make_ckpt(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text("{not json")
    assert "not valid JSON" in err(EngineConfig.create, model=str(tmp_path / "b"))


def test_profile_dir(ckpt: Path, tmp_path: Path) -> None:
    assert EngineConfig.create(model=str(ckpt), profile_dir=str(tmp_path)).profile_dir == str(tmp_path)
    assert err(EngineConfig.create, model=str(ckpt), profile_dir=str(tmp_path / "nope")).startswith("--profile")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert "not writable" in err(EngineConfig.create, model=str(ckpt), profile_dir=str(ro))
        finally:
            ro.chmod(0o700)


def test_frozen(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 3  # type: ignore[misc]


def test_sharded_index_is_enough(tmp_path: Path) -> None:
    """The index's weight_map decides; the shards it names are never opened (here: absent)."""
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    wm = {"embed.weight": "model-00001-of-00002.safetensors",
          "mtp.0.enorm.weight": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert EngineConfig.create(model=str(d)).has_mtp
    del wm["mtp.0.enorm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert not EngineConfig.create(model=str(d)).has_mtp


def test_validation_reads_headers_only(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only safe_open(...).keys() may be used: any tensor read or full load fails the test."""
    real = safetensors.safe_open
    opened = []

    class HeaderOnly:
        def __init__(self, filename, framework, device="cpu"):
            opened.append(filename)
            self._h = real(filename, framework=framework, device=device)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def __getattr__(self, name):
            raise AssertionError(f"validation read weights via safe_open().{name}")

    def forbidden(*a, **k):
        raise AssertionError("validation loaded weights")

    monkeypatch.setattr(safetensors, "safe_open", HeaderOnly)
    monkeypatch.setattr("safetensors.torch.load_file", forbidden)
    monkeypatch.setattr("safetensors.torch.load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    c = EngineConfig.create(model=str(ckpt), num_speculative_tokens=2)
    assert c.has_mtp and opened == [str(ckpt / "model.safetensors")]
    # and a bad config is rejected the same way, before anything else
    with pytest.raises(EngineConfigError):
        EngineConfig.create(model=str(ckpt), enable_chunked_prefill=False, max_model_len=4096)


def test_corrupt_safetensors_named(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 4)
    msg = err(EngineConfig.create, model=str(ckpt))
    assert msg.startswith("--model ") and "model.safetensors" in msg


def test_model_that_cannot_carry_speculation_across_chunks(ckpt: Path, monkeypatch) -> None:
    from dsv4.config import ModelConfig

    assert EngineConfig.create(model=str(ckpt), num_speculative_tokens=1).single_dispatch is False
    monkeypatch.setattr(ModelConfig, "speculation_spans_chunks", property(lambda self: False))
    cfg = EngineConfig.create(model=str(ckpt), num_speculative_tokens=1, max_model_len=128)
    assert cfg.single_dispatch and "not supported" in cfg.banner_lines()[-1]
    assert not EngineConfig.create(model=str(ckpt), num_speculative_tokens=0, max_model_len=4096).single_dispatch
    msg = err(EngineConfig.create, model=str(ckpt), num_speculative_tokens=1, max_model_len=4096)
    assert "cannot carry the MTP state" in msg and "--num-speculative-tokens 0" in msg


def test_threads_flag_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4.engine.config import MAX_DEFAULT_THREADS, default_threads

    d = make_ckpt(tmp_path)
    assert EngineConfig.create(model=str(d), threads=3).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert default_threads() == 2 and EngineConfig.create(model=str(d)).threads == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= default_threads() <= min(len(os.sched_getaffinity(0)), MAX_DEFAULT_THREADS)
    with pytest.raises(EngineConfigError, match="--threads"):
        EngineConfig.create(model=str(d), threads=0)


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (3, 2), (8, 7), (17, 16), (64, 16)])
def test_default_threads_leave_a_core_free(cpus: int, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fewer than the usable CPUs (a team on every core collapses beside any other work:
    benchmarks/busy_threads.py), at least 1, at most MAX_DEFAULT_THREADS; $OMP_NUM_THREADS,
    the user's choice, wins whatever the machine, and --threads wins over both."""
    from dsv4.engine.config import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_threads() == expected
    monkeypatch.setenv("OMP_NUM_THREADS", str(cpus))
    assert default_threads() == cpus
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # set but empty: as if unset
    assert default_threads() == expected


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 2), (8, 8), (64, 16)])
def test_threads_that_wait_passively_take_every_core(cpus: int, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With OMP_WAIT_POLICY=PASSIVE (set by the CLI for long-step models, or by the user) a
    team's threads sleep at each barrier instead of spinning, so none is kept back; the
    banner says so."""
    from dsv4.engine.config import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_threads() == expected
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert default_threads() == max(1, min(cpus - 1, 16))


FLASH_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek-v4-flash"


def test_the_cli_makes_openmp_wait_passively_for_long_step_models_only(tmp_path: Path) -> None:
    """`cli.options.choose_wait_policy`, as `build_config` calls it before torch loads: PASSIVE for
    V4 Flash's widths (hidden 4096), nothing for the embedded model; never over the user's own
    policy, and never once torch (OpenMP) is loaded, when it would no longer take effect."""
    from dsv4.cli.options import engine_kwargs

    code = ("import os, sys; from dsv4.cli.options import choose_wait_policy; {pre}"
            "print(choose_wait_policy(sys.argv[1]), os.environ.get('OMP_WAIT_POLICY'))")
    embedded = engine_kwargs()["model"]

    def run(model: str, pre: str = "", **env: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
        return subprocess.run([sys.executable, "-c", code.format(pre=pre), model], capture_output=True, text=True,
                              env=environ, check=True).stdout.strip()

    assert run(str(FLASH_CONFIG)) == "True PASSIVE"
    assert run(embedded) == "False None"
    assert run(str(FLASH_CONFIG), OMP_WAIT_POLICY="active") == "False active"
    assert run(str(FLASH_CONFIG), pre="import torch; ") == "False None"
    assert run(str(tmp_path)) == "False None"  # no config.json: nothing to judge by


def test_generation_config_defaults_read_at_validation(tmp_path: Path) -> None:
    d = make_ckpt(tmp_path)
    assert EngineConfig.create(model=str(d)).sampling_defaults == {}
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "max_length": 9,
                                                          "do_sample": False}))
    assert EngineConfig.create(model=str(d)).sampling_defaults == {"temperature": 0.0, "top_p": 0.9}
    (d / "generation_config.json").write_text("{broken")
    with pytest.raises(EngineConfigError, match="generation_config.json"):
        EngineConfig.create(model=str(d))


def test_kv_cache_memory_sizes_the_pool_and_refuses_one_too_small(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt), max_model_len=1000, num_speculative_tokens=0)
    per = block_entry_bytes(c.model_config, 256, 4)
    assert c.kv_cache_blocks == 8 * 4  # 8 requests of ceil(1001 / 256) blocks
    for given, blocks in ((f"{10 * per}", 10), (f"{10 * per + per - 1}", 10), ("1MiB", 2**20 // per)):
        c = EngineConfig.create(model=str(ckpt), max_model_len=1000, num_speculative_tokens=0, kv_cache_memory=given)
        assert c.kv_cache_blocks == blocks and c.kv_cache_memory == blocks * per
    assert 0 < free_memory("cpu") <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.MonkeyPatch.context() as mp:  # a fraction of the memory free at startup
        mp.setattr("dsv4.engine.checks.free_memory", lambda device: 10**9)
        frac = EngineConfig.create(model=str(ckpt), num_speculative_tokens=0, kv_cache_memory="0.01")
    assert frac.kv_cache_blocks == 10**7 // per
    msg = err(EngineConfig.create, model=str(ckpt), max_model_len=1000, num_speculative_tokens=0,
              kv_cache_memory=str(3 * per))
    assert "--kv-cache-memory" in msg and f"{4 * per}" in msg and "--max-model-len" in msg  # names the bytes
    for bad in ("lots", "-5", "0", "1.5x", ""):
        assert "--kv-cache-memory" in err(EngineConfig.create, model=str(ckpt), kv_cache_memory=bad)
    assert "--enable-prefix-caching" in err(EngineConfig.create, model=str(ckpt), enable_prefix_caching="yes")
