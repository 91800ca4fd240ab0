"""The memory plan (`dsv4 plan`, and the refusal `serve` / `run --local` make before loading):
the published DeepSeek V4 Flash and Pro config.json (tests/fixtures, no weights) sized part by
part, the experts' shortcut equal to the whole meta model, and a configuration over the
machine refused with its figures and the flags that would fit."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from dsv4.cli.main import main
from dsv4.cli.options import engine_kwargs
from dsv4.engine import memory_plan as M
from dsv4.engine.config import EngineConfig
from dsv4.engine.checks import EngineConfigError
from tests.checkpoints import write_tiny_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GIB = 2**30


def _plan(capsys, model: str, *args: str) -> dict:
    code = main(["plan", "--model", str(FIXTURES / model), "--json", *args])
    got = capsys.readouterr()
    assert got.out.strip(), got.err
    out = json.loads(got.out)
    assert code == (0 if out["fits"] else 1)
    return out


def test_v4_flash_with_fp4_experts_fits_192_gb_at_a_64k_context(capsys):
    for q in ("w8a8-mxfp4", "mxfp4"):
        p = _plan(capsys, "deepseek-v4-flash", "--quantization", q, "--dtype", "bfloat16",
                  "--max-model-len", "65536", "--memory", "192GiB")
        parts = {x["what"]: x["bytes"] for x in p["parts"]}
        # 43 layers + MTP, 256 experts of w1, w3 [2048, 4096] and w2 [4096, 2048]: half a byte a
        # weight and one E8M0 byte per 32
        assert parts["weights: routed experts"] == 44 * 256 * 3 * 2048 * 4096 * (16 + 1) // 32
        assert p["fits"] and p["host_bytes"] < 170 * GIB, p
        print(f"V4 Flash {q}: {p['host_bytes'] / GIB:.1f} GiB at 64k", file=sys.stderr)
    w8a8 = _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8", "--dtype", "bfloat16",
                 "--max-model-len", "65536", "--memory", "192GiB")
    assert not w8a8["fits"] and w8a8["host_bytes"] > 270 * GIB  # int8 experts: twice the bytes


def test_v4_pro_says_what_it_needs(capsys):
    p = _plan(capsys, "deepseek-v4-pro", "--quantization", "w8a8-mxfp4", "--dtype", "bfloat16",
              "--max-model-len", "65536", "--memory", "192GiB")
    print(f"V4 Pro w8a8-mxfp4: {p['host_bytes'] / GIB:.0f} GiB at 64k", file=sys.stderr)
    assert not p["fits"] and 780 * GIB < p["host_bytes"] < 860 * GIB
    tp = _plan(capsys, "deepseek-v4-pro", "--quantization", "w8a8-mxfp4", "--dtype", "bfloat16",
               "--max-model-len", "65536", "--tensor-parallel-size", "8", "--nnodes", "8", "--memory", "192GiB")
    assert tp["fits"] and tp["ranks_here"] == 1 and tp["per_rank_bytes"] < p["per_rank_bytes"] / 7


def test_engine_replicas_each_count(capsys):
    """--data-parallel-size N: every replica holds its own weights and state (planned for a
    machine of 16 CPUs: the cores are not this one's)."""
    one = _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8-mxfp4", "--dtype", "bfloat16",
                "--max-model-len", "65536", "--memory", "400GiB")
    two = _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8-mxfp4", "--dtype", "bfloat16",
                "--max-model-len", "65536", "--memory", "400GiB", "--data-parallel-size", "2")
    assert one["fits"] and two["data_parallel_size"] == 2 and two["ranks_here"] == 2
    assert two["per_rank_bytes"] == one["per_rank_bytes"] and two["host_bytes"] == 2 * one["host_bytes"]
    assert not _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8-mxfp4", "--dtype", "bfloat16",
                     "--max-model-len", "65536", "--memory", "192GiB", "--data-parallel-size", "2")["fits"]


@pytest.mark.parametrize("q, T", [("none", 1), ("w8a8", 2), ("w8a8-mxfp4", 1), ("mxfp4", 2)])
def test_the_experts_shortcut_equals_the_whole_meta_model(tmp_path, q, T):
    write_tiny_checkpoint(tmp_path, quantize=True)
    c = EngineConfig.create(model=str(tmp_path), quantization=q, tensor_parallel_size=T)
    fast, exact = M.weight_parts(c), M.weight_parts(c, exact=True)
    assert [(p.what, p.bytes, p.detail) for p in fast] == [(p.what, p.bytes, p.detail) for p in exact]


def test_a_plan_over_the_machine_is_refused_naming_figures_and_flags(tmp_path, monkeypatch, capsys):
    write_tiny_checkpoint(tmp_path, quantize=True)
    c = EngineConfig.create(model=str(tmp_path))
    need = M.memory_plan(c).host_bytes
    monkeypatch.setattr(M, "available_memory", lambda: need - 1)
    with pytest.raises(EngineConfigError) as e:
        M.check(c)
    msg = str(e.value)
    assert "over the" in msg and "available" in msg and "--quantization w8a8" in msg and "--max-model-len" in msg
    assert "\n" not in msg
    # through the CLI: one line, exit 2, before any weight is read
    import dsv4.engine.engine  # noqa: F401  (imported first, so that it binds the real load_model afterwards)

    monkeypatch.setattr("dsv4.engine.engine.load_model", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = main(["run", "--local", "--model", str(tmp_path), "--quantization", "none", "--max-tokens", "2",
                 "--raw", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "dsv4 plan" in err, err


def test_without_quantization_the_defaults_take_what_fits(tmp_path, monkeypatch, capsys):
    """No --quantization: float32 where it fits (the exactness promise), else the checkpoint's
    own formats (FP4 experts as stored), said in one line on stderr; never past memory."""
    write_tiny_checkpoint(tmp_path, quantize=True)
    c = EngineConfig.create(model=str(tmp_path))
    assert c.quantization == "none" and M.fit_default(c) == (c, "")  # it fits this machine
    need = M.memory_plan(c).host_bytes
    chosen, note = M.fit_default(c, available=need - 1)
    assert chosen.quantization == "w8a8-mxfp4" and "--quantization w8a8-mxfp4 chosen" in note and "\n" not in note
    assert M.memory_plan(chosen, need - 1).fits()
    smallest = M.memory_plan(EngineConfig.create(model=str(tmp_path), quantization="w8a8-mxfp4")).host_bytes
    assert M.fit_default(c, available=smallest - 1) == (c, "")  # nothing fits: check() refuses it
    # V4 Flash at 64k in 192 GB: FP4 experts as stored (int8 for the rest) is the first that fits
    flash = EngineConfig.create(model=str(FIXTURES / "deepseek-v4-flash"), planning=True, dtype="bfloat16",
                                max_model_len=65536)
    assert M.fit_default(flash, available=192 * 10**9)[0].quantization == "w8a8-mxfp4"
    # through the CLI (its own defaults: --compile's scratch slot): the run goes on in the chosen format
    cli = EngineConfig.create(**engine_kwargs(model=tmp_path, compile=None))
    cli_need = M.memory_plan(cli).host_bytes
    monkeypatch.setattr(M, "available_memory", lambda: cli_need - 1)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = main(["run", "--local", "--model", str(tmp_path), "--max-tokens", "2", "--raw", "--json", "hi"])
    got = capsys.readouterr()
    assert code == 0 and "--quantization w8a8-mxfp4 chosen" in got.err, got.err


def test_the_python_api_plans_as_the_cli_does(tmp_path, monkeypatch, caplog):
    """`LLM(dir)` (no quantization) took float32 whatever it needed, and a V4 checkpoint met the
    OOM killer: it now settles the config as the CLI does, before any weight loads: the
    formats that fit, logged, and a refusal naming the figures where nothing fits."""
    from dsv4 import LLM

    write_tiny_checkpoint(tmp_path, quantize=True, with_tokenizer=False)
    need = M.memory_plan(EngineConfig.create(model=str(tmp_path), max_model_len=64)).host_bytes
    assert LLM(str(tmp_path), max_model_len=64).engine.config.quantization == "none"  # it fits: float32
    monkeypatch.setattr(M, "available_memory", lambda: need - 1)
    with caplog.at_level("WARNING", logger="dsv4"):
        llm = LLM(str(tmp_path), max_model_len=64)
    assert llm.engine.config.quantization == "w8a8-mxfp4" and "--quantization w8a8-mxfp4 chosen" in caplog.text
    assert LLM(str(tmp_path), max_model_len=64, quantization="w8a8").engine.config.quantization == "w8a8"
    loads = []
    monkeypatch.setattr("dsv4.engine.engine.Engine.__init__", lambda self, config: loads.append(config))
    monkeypatch.setattr(M, "available_memory", lambda: 1 << 20)
    with pytest.raises(EngineConfigError, match=r"needs .* over the .* available; it would fit with"):
        LLM(str(tmp_path), max_model_len=64)
    with pytest.raises(EngineConfigError, match="over the"):
        LLM(str(tmp_path), max_model_len=64, quantization="none")
    assert loads == []  # refused before the engine (and its weights) was built


def test_a_compile_build_is_planned_and_refused_before_it_runs_out_of_memory(tmp_path, monkeypatch, capsys):
    """--compile captures missing buckets in the serving process, which holds a second copy of
    the weights while it does: the plan counts it, and a build that would not fit is refused
    before anything loads, naming the default (auto: cached buckets, background builds) that fits."""
    write_tiny_checkpoint(tmp_path, quantize=True)
    build = EngineConfig.create(model=str(tmp_path), quantization="w8a8", compile=True)
    auto = EngineConfig.create(model=str(tmp_path), quantization="w8a8", compile="auto")
    plan, auto_plan = M.memory_plan(build), M.memory_plan(auto)
    weights = sum(p.bytes for p in plan.parts if p.what.startswith("weights"))
    parts = {p.what: p.bytes for p in plan.parts}
    assert parts[M.COMPILE_BUILD] == weights > 0 and M.COMPILE_BUILD not in {p.what for p in auto_plan.parts}
    assert plan.host_bytes == auto_plan.host_bytes + weights
    monkeypatch.setattr(M, "available_memory", lambda: auto_plan.host_bytes)  # auto fits, the build does not
    with pytest.raises(EngineConfigError) as e:
        M.check(build)
    msg = str(e.value)
    assert M.COMPILE_BUILD in msg and "--compile auto, the default" in msg and "\n" not in msg, msg
    M.check(auto)
    # `dsv4 plan --compile` shows the part; without the flag it is not there
    with_build = _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8-mxfp4", "--compile", "--memory", "192GiB")
    without = _plan(capsys, "deepseek-v4-flash", "--quantization", "w8a8-mxfp4", "--memory", "192GiB")
    built = {x["what"]: x["bytes"] for x in with_build["parts"]}
    assert M.COMPILE_BUILD in built and M.COMPILE_BUILD not in {x["what"] for x in without["parts"]}
    assert with_build["host_bytes"] == without["host_bytes"] + built[M.COMPILE_BUILD]


def test_the_head_is_planned_as_the_loader_holds_it(tmp_path, capsys):
    """Under the int8 modes in float32 on the CPU the official BF16 head stays BF16
    (`loader.head_as_stored`); otherwise, and for a checkpoint that stores it in float32, it
    is float32. The plan counts what the loader will hold."""
    V, D = 129280, 4096
    for q, dtype, head_bytes in [("w8a8-mxfp4", "float32", 2), ("w8a8", "float32", 2), ("mxfp4", "float32", 4),
                                 ("w8a8-mxfp4", "bfloat16", 2)]:
        p = _plan(capsys, "deepseek-v4-flash", "--quantization", q, "--dtype", dtype, "--memory", "512GiB")
        part = next(x for x in p["parts"] if x["what"] == "weights: embedding and head")
        embed = V * D * (4 if dtype == "float32" else 2)
        draft = V * (D + 4) if q.startswith("w8a8") else 0
        assert part["bytes"] == embed + V * D * head_bytes + draft, (q, dtype, part)
    write_tiny_checkpoint(tmp_path / "f32", quantize=True, with_tokenizer=False)
    write_tiny_checkpoint(tmp_path / "bf16", quantize=True, with_tokenizer=False, head_bf16=True)
    sizes = {}
    for name in ("f32", "bf16"):
        config = EngineConfig(**engine_kwargs(model=str(tmp_path / name), quantization="w8a8"))
        plan = {x.what: x.bytes for x in M.weight_parts(config)}
        sizes[name] = plan["weights: embedding and head"]
    cfg = config.model_config
    assert sizes["f32"] - sizes["bf16"] == cfg.vocab_size * cfg.hidden_size * 2
