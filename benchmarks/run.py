#!/usr/bin/env python3
"""dsv4's benchmark suite: every figure is a ratio against a peer measured in the same run.

    python benchmarks/run.py [--model DIR] [--data DIR] [--device cpu|cuda] [--out DIR] [--quick]
    python benchmarks/run.py --acceptance [--k 1] [--prompts 8] [--gen 64]

`--acceptance` measures only MTP acceptance (K = 1 by default, concurrency 8) on held-out
256-token prompts, greedy and at the model's default sampling (its generation_config.json,
EOS ignored; unseeded, then seeded), and prints one line per arm.

On the embedded default model (or --model), measures:

1. decode at batch 1, greedy, 256-token prompt, 128 new tokens: dsv4 (K = 0) versus
   transformers' `DeepseekV4ForCausalLM.generate` on the very same weights;
2. time to first token for a 256-token prompt: dsv4 versus one transformers forward;
3. MTP K = 1, 2, 3 versus K = 0 on held-out text prompts at concurrency 1 and 8;
4. concurrency scaling 1, 2, 4, 8 (aggregate output tok/s), and concurrency 8 again with
   a step budget of four prefill chunks (`--max-num-batched-tokens`);
5. the limit: weight bytes one decode step reads (active experts only) over the memory
   bandwidth a copy reaches in this run, against the measured time per token;
6. memory: peak resident memory and per-request state bytes against the config's figure.

Writes `OUT/benchmarks.md` (tables ready for BENCHMARKS.md) and `OUT/benchmarks.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import time
from pathlib import Path

import torch

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.config import CSA, WINDOW, ModelConfig
from dsv4.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    d = {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
         "commit": commit.strip(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
    return d


def heldout_prompts(tok: Tokenizer, data: Path, n: int, length: int) -> list[list[int]]:
    ids: list[int] = []
    for f in sorted((data / "heldout").glob("*.txt")):
        ids += tok.encode(f.read_text(encoding="utf-8"))
    if len(ids) < length:
        raise SystemExit(f"benchmarks/run.py: no held-out texts in {data / 'heldout'} (--data names a folder "
                         f"with a heldout/ folder of .txt files, like data/shakespeare)")
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step: i * step + length] for i in range(n)]


def drive(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all prompts are done."""
    eng = llm.engine
    todo, live, done = list(prompts), set(), []
    t0 = time.monotonic()
    while todo or live:
        while todo and len(live) < concurrency:
            live.add(eng.add_request(todo.pop(0), params))
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                done.append(out.metrics)
    wall = time.monotonic() - t0
    toks = sum(m["usage"]["completion_tokens"] for m in done)
    drafted = sum(m["spec"]["drafted"] for m in done)
    accepted = sum(m["spec"]["accepted"] for m in done)
    tpots = sorted(m["timings"]["tpot_s"] for m in done if m["timings"]["tpot_s"] is not None)
    ttfts = sorted(m["timings"]["ttft_s"] for m in done)
    steps = sum(m["spec"]["verify_steps"] for m in done)
    return {"requests": len(done), "output_tok_s": toks / wall, "wall_s": wall,
            "tpot_ms": 1000 * sum(tpots) / len(tpots), "tpot_p50_ms": 1000 * tpots[len(tpots) // 2],
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / steps if steps else None}


def hf_model(model_dir: Path, device: str, dtype: torch.dtype):
    import transformers

    from dsv4.model.hf_compat import hf_config_dict, official_to_hf
    from dsv4.model.loader import load_model

    m = load_model(model_dir)
    cfg = m.cfg
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_config_dict(cfg)))
    hf.load_state_dict(official_to_hf(m.state_dict(), cfg), strict=True)
    return hf.eval().to(device=device, dtype=dtype)


def sync(device: str) -> None:
    """Wait for queued device work, so that wall-clock times are whole."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_vs_transformers(model_dir: Path, prompt: list[int], new: int, device: str, dtype: str, reps: int) -> dict:
    hf = hf_model(model_dir, device, getattr(torch, dtype))
    ids = torch.tensor([prompt], device=device)
    llm = LLM(model_dir, num_speculative_tokens=0, max_num_seqs=1, device=device, dtype=dtype, max_model_len=1024)
    p = SamplingParams(max_tokens=new, ignore_eos=True)
    res: dict = {}
    best = {"dsv4": 1e9, "hf": 1e9, "dsv4_ttft": 1e9, "hf_fwd": 1e9}
    for _ in range(reps):  # interleaved, best of reps: the machine is shared and noisy
        t = time.monotonic()
        (c,) = llm.generate([prompt], p)
        best["dsv4"] = min(best["dsv4"], time.monotonic() - t)
        best["dsv4_ttft"] = min(best["dsv4_ttft"], c.metrics["timings"]["ttft_s"])
        with torch.no_grad():
            sync(device)
            t = time.monotonic()
            out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            sync(device)
            best["hf"] = min(best["hf"], time.monotonic() - t)
            t = time.monotonic()
            hf(ids, use_cache=False)
            sync(device)
            best["hf_fwd"] = min(best["hf_fwd"], time.monotonic() - t)
        res["same_tokens"] = out[0, len(prompt):].tolist() == c.token_ids
    res.update({"dsv4_tok_s": new / best["dsv4"], "hf_tok_s": new / best["hf"],
                "decode_ratio": best["hf"] / best["dsv4"], "dsv4_ttft_ms": 1000 * best["dsv4_ttft"],
                "hf_forward_ms": 1000 * best["hf_fwd"], "ttft_ratio": best["dsv4_ttft"] / best["hf_fwd"]})
    return res


def active_weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Bytes of weights one decode token reads: attention, shared + top-k routed experts, head."""
    D, hd, H = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    n = 0
    for kind in cfg.layer_kinds:
        n += D * cfg.q_lora_rank + cfg.q_lora_rank * H * hd + D * hd
        n += H * hd * cfg.o_lora_rank  # wo_a: G blocks of [O, H*hd/G]
        n += cfg.o_groups * cfg.o_lora_rank * D
        if kind != WINDOW:
            n += 2 * D * hd * (2 if kind == CSA else 1)
        if kind == CSA:
            di = cfg.index_head_dim
            n += cfg.q_lora_rank * cfg.index_n_heads * di + D * cfg.index_n_heads + 2 * D * 2 * di
        n += D * cfg.n_routed_experts  # router
        n += 3 * D * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
        n += 2 * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * D
    n += cfg.vocab_size * D + cfg.hc_mult * cfg.hc_mult * D
    return n * elem


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    a = torch.empty(nbytes // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = 1e9
    for _ in range(5):
        sync(device)
        t = time.monotonic()
        b.copy_(a)
        sync(device)
        best = min(best, time.monotonic() - t)
    return 2 * nbytes / best  # read + write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=dsv4.DEFAULT_MODEL)
    ap.add_argument("--data", type=Path, default=ROOT / "data/shakespeare")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on cpu, else bfloat16)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench")
    ap.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    ap.add_argument("--acceptance", action="store_true", help="only MTP acceptance, greedy and default sampling")
    ap.add_argument("--k", type=int, default=1, help="--acceptance: drafts per step")
    ap.add_argument("--prompts", type=int, default=8, help="--acceptance: held-out prompts")
    ap.add_argument("--gen", type=int, default=64, help="--acceptance: tokens per prompt")
    a = ap.parse_args()
    if a.acceptance:
        return acceptance(a)
    a.out.mkdir(parents=True, exist_ok=True)
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    tok = Tokenizer.from_dir(a.model)
    cfg = ModelConfig.from_dir(a.model)
    reps, n_prompts, gen = (1, 8, 32) if a.quick else (3, 16, 64)
    prompts = heldout_prompts(tok, a.data, n_prompts, 256)
    R: dict = {"machine": machine(), "model": str(a.model), "device": a.device, "dtype": dtype}
    print("decode and TTFT versus transformers ...", flush=True)
    R["vs_transformers"] = decode_vs_transformers(a.model, prompts[0], 128, a.device, dtype, reps)
    print("MTP arms and concurrency ...", flush=True)
    p = SamplingParams(max_tokens=gen, ignore_eos=True)
    R["mtp"] = {}
    for K in (0, 1, 2, 3):
        llm = LLM(a.model, num_speculative_tokens=K, max_num_seqs=8, device=a.device, dtype=dtype, max_model_len=1024)
        drive(llm, prompts[:2], p, 2)  # warmup
        if K == 1:
            state_bytes = llm.engine.runner.state.nbytes_per_slot()
        for c in (1, 2, 4, 8) if K in (0, 1) else (1, 8):
            R["mtp"][f"K{K}_c{c}"] = drive(llm, prompts, p, c)
            print(f"  K={K} c={c}: {R['mtp'][f'K{K}_c{c}']['output_tok_s']:.1f} tok/s", flush=True)
    budget = 4 * cfg.prefill_limit + 8  # four prefill chunks (of different requests) per step
    llm = LLM(a.model, num_speculative_tokens=0, max_num_seqs=8, device=a.device, dtype=dtype, max_model_len=1024,
              max_num_batched_tokens=budget)
    drive(llm, prompts[:2], p, 2)
    R["budget"] = {"max_num_batched_tokens": budget, "c8": drive(llm, prompts, p, 8)}
    print(f"  K=0 c=8 budget {budget}: {R['budget']['c8']['output_tok_s']:.1f} tok/s", flush=True)
    k0 = R["mtp"]["K0_c1"]
    bw = copy_bandwidth(a.device)
    wbytes = active_weight_bytes(cfg, 4 if dtype == "float32" else 2)
    R["limit"] = {"active_weight_bytes": wbytes, "copy_bandwidth_GB_s": bw / 1e9,
                  "limit_ms_per_token": 1000 * wbytes / bw, "measured_tpot_ms": k0["tpot_ms"],
                  "fraction_of_limit": (wbytes / bw) / (k0["tpot_ms"] / 1000)}
    R["memory"] = {"peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "peak_device_MiB": (torch.cuda.max_memory_allocated() / 2**20
                                       if a.device.startswith("cuda") else None),
                   "state_bytes_per_request": state_bytes,  # K = 1, max_model_len 1024
                   "state_bytes_per_request_logical": logical_state_bytes(cfg, 1024, 4 if dtype == "float32" else 2)}
    (a.out / "benchmarks.json").write_text(json.dumps(R, indent=2) + "\n")
    md = report(R)
    (a.out / "benchmarks.md").write_text(md)
    print(md)


def acceptance(a: argparse.Namespace) -> None:
    """MTP acceptance at K = a.k on held-out prompts, greedy and at the model's default sampling."""
    tok = Tokenizer.from_dir(a.model)
    prompts = heldout_prompts(tok, a.data, a.prompts, 256)
    llm = LLM(a.model, num_speculative_tokens=a.k, max_num_seqs=8, device=a.device, max_model_len=1024)
    default = llm.engine.default_params
    arms = {"greedy": SamplingParams(max_tokens=a.gen, ignore_eos=True),
            "temperature 0 over the defaults (penalties kept)": SamplingParams(
                **{**default.__dict__, "temperature": 0.0, "max_tokens": a.gen, "ignore_eos": True}),
            "default sampling": SamplingParams(**{**default.__dict__, "max_tokens": a.gen, "ignore_eos": True}),
            "default sampling, seed 0": SamplingParams(**{**default.__dict__, "max_tokens": a.gen, "ignore_eos": True,
                                                          "seed": 0})}
    for name, params in arms.items():
        r = drive(llm, prompts, params, 8)
        print(f"K={a.k} {name} ({a.prompts} held-out prompts x {a.gen} tokens): acceptance "
              f"{r['acceptance_rate']:.3f}, mean acceptance length {r['mean_acceptance_length']:.3f}", flush=True)


def logical_state_bytes(cfg: ModelConfig, max_len: int, elem: int) -> int:
    """What a request at max_len must keep: windows, compressed entries, open windows (+ MTP window)."""
    W, hd, n = cfg.sliding_window, cfg.head_dim, 0
    for kind, m in zip(cfg.layer_kinds, cfg.compress_ratios):
        n += (W - 1) * hd
        if kind != WINDOW:
            coff = 2 if kind == CSA else 1
            n += (max_len // m) * hd + 2 * m * coff * hd * 2  # entries, open + overlap rows (kv and score)
        if kind == CSA:
            di = cfg.index_head_dim
            n += (max_len // m) * di + 2 * m * 2 * di * 2
    if cfg.num_nextn_predict_layers:
        n += (W - 1) * hd
    return n * elem


def report(R: dict) -> str:
    m, v, L, M = R["machine"], R["vs_transformers"], R["limit"], R["memory"]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"Machine: {m['cpu']} ({m['cores']} threads){', ' + m['gpu'] if 'gpu' in m else ''}, torch {m['torch']}, "
             f"device {R['device']}, {R.get('dtype', 'float32')}, "
             f"commit {m['commit']}, {m['date']}", "",
             "| decode, batch 1, 256-token prompt, 128 new tokens | tok/s |", "|---|---|",
             f"| dsv4 (K = 0) | {f(v['dsv4_tok_s'], 1)} |", f"| transformers generate | {f(v['hf_tok_s'], 1)} |",
             f"| **ratio** | **{f(v['decode_ratio'])}x** (same tokens: {v['same_tokens']}) |", "",
             "| time to first token, 256 tokens | ms |", "|---|---|",
             f"| dsv4 | {f(v['dsv4_ttft_ms'], 1)} |", f"| transformers, one forward | {f(v['hf_forward_ms'], 1)} |",
             f"| **ratio dsv4 / transformers** | **{f(v['ttft_ratio'])}** |", "",
             "| MTP, held-out prompts | concurrency | output tok/s | vs K=0 | TPOT ms | acceptance | mean acc. length |",
             "|---|---|---|---|---|---|---|"]
    for key, r in R["mtp"].items():
        K, c = key[1], key.split("_c")[1]
        base = R["mtp"][f"K0_c{c}"]["output_tok_s"]
        lines.append(f"| K = {K} | {c} | {f(r['output_tok_s'], 1)} | {f(r['output_tok_s'] / base)}x | "
                     f"{f(r['tpot_ms'], 1)} | {f(r['acceptance_rate'])} | {f(r['mean_acceptance_length'])} |")
    c1 = R["mtp"]["K0_c1"]["output_tok_s"]
    lines += ["", "| concurrency (K = 0) | aggregate tok/s | vs 1 |", "|---|---|---|"]
    for c in (1, 2, 4, 8):
        r = R["mtp"][f"K0_c{c}"]
        lines.append(f"| {c} | {f(r['output_tok_s'], 1)} | {f(r['output_tok_s'] / c1)}x |")
    b = R["budget"]
    lines.append(f"| 8, `--max-num-batched-tokens {b['max_num_batched_tokens']}` | "
                 f"{f(b['c8']['output_tok_s'], 1)} | {f(b['c8']['output_tok_s'] / c1)}x |")
    lines += ["", "| the limit | |", "|---|---|",
              f"| active weight bytes per decode step | {L['active_weight_bytes'] / 1e6:.1f} MB |",
              f"| copy bandwidth (this run) | {f(L['copy_bandwidth_GB_s'], 1)} GB/s |",
              f"| bandwidth limit per token | {f(L['limit_ms_per_token'], 3)} ms |",
              f"| measured TPOT (K = 0, c = 1) | {f(L['measured_tpot_ms'], 2)} ms |",
              f"| fraction of the limit reached | {100 * L['fraction_of_limit']:.1f}% |", "",
              "| memory | |", "|---|---|", f"| peak resident | {f(M['peak_rss_MiB'], 0)} MiB |",
              *([f"| peak device memory | {f(M['peak_device_MiB'], 0)} MiB |"] if M.get("peak_device_MiB") else []),
              f"| state per request, allocated (max_model_len 1024) | {M['state_bytes_per_request'] / 2**20:.2f} MiB |",
              f"| state per request, from the config | {M['state_bytes_per_request_logical'] / 2**20:.2f} MiB |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
