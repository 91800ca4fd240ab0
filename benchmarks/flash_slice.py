#!/usr/bin/env python3
"""A DeepSeek V4 Flash-shaped slice: real dimensions, 8 layers + MTP, 16 routed experts.

    python benchmarks/flash_slice.py --dir /scratch/flash --make      # ~5 GB of random FP8/FP4 weights
    python benchmarks/flash_slice.py --dir /scratch/flash             # every arm, each in its own process

The slice has V4 Flash's real sizes (hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8,
o_lora 1024, expert width 2048, top-6 + the shared expert, index 64 x 128, vocab 129280)
and 8 layers alternating CSA(4) and HCA(128) plus the MTP layer, with 16 routed experts a
layer instead of 256: each token still reads 6 real-size experts, so the bytes one decode
token reads per layer are the real model's. Weights are random, written tensor by tensor
in the official format (FP8 128x128 blocks, FP4 1x32 blocks, E8M0 scales) to a scratch
directory that is not part of the repository.

Per arm (`none` in bfloat16, `w8a8` with its int8 weights prepacked for oneDNN as the
engine loads them, `w8a8-unpacked` through `torch._int_mm`; fp32 needs ~24 GB and is skipped), in a fresh
process: resident weight bytes (all, and the layers' without embedding and head), peak
RSS, decode time per step at batch 1 and 4 (the model's forward, K = 0, 64-token
contexts), the bytes one batch-1 step reads and the floor they imply at the copy
bandwidth measured in the same process, and the cost of a 2-token verify row and of an
MTP draft against a 1-token step, with the MTP speedup that implies at acceptance `--accept`.
The `transformers:bfloat16` arm runs transformers' DeepseekV4ForCausalLM (main model, no
MTP) on the same weights (`benchmarks/flash_slice_hf.py`): resident bytes, peak RSS,
batch-1 decode. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

PREFILL = 128  # the prefill row timed: one chunk of this many tokens after the 64-token context
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "sliding_window": 128, "compress_ratios": [4, 128] * 4 + [0], "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                            "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "moe_intermediate_size": 2048,
    "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


# ------------------------------------------------------------------ generation
def _tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> dict[str, torch.Tensor]:
    """One random tensor in its official storage format (weight and maybe its E8M0 scale)."""
    from dsv4.model.checkpoint import official_storage, scale_name
    from dsv4.model.quant import E8M0, quantize_fp8

    fmt, leaf = official_storage(name), name.rsplit(".", 1)[-1]
    if fmt == "fp4":  # random nibbles; block exponents near 3 sigma / 6 of a 1/sqrt(fan_in) weight
        rows, cols = shape
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).view(torch.int8)
        e = 127 + round(math.log2(3 / math.sqrt(cols) / 6))
        sc = torch.randint(e - 1, e + 1, (rows, cols // 32), generator=g, dtype=torch.uint8)
        return {name: packed, scale_name(name): sc.view(E8M0) if E8M0 is not None else sc}
    if fmt == "i64":
        E, k = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"]
        return {name: torch.rand(shape[0], E, generator=g).argsort(-1)[:, :k].contiguous()}
    t = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * t
    elif leaf.endswith("_scale"):
        t = 1.0 + 0.1 * t
    elif leaf.endswith("_base") or leaf in ("ape", "attn_sink", "bias"):
        t = 0.1 * t
    elif leaf.endswith("_fn"):
        t = 0.02 * t
    elif name != "embed.weight" and t.dim() == 2:
        t = t / math.sqrt(shape[-1])
    if fmt == "fp8":
        q, s = quantize_fp8(t)
        return {name: q, scale_name(name): s}
    return {name: t.to(torch.float32 if fmt == "f32" else torch.bfloat16)}


def make(out: Path, shard_bytes: int = 2 << 30) -> None:
    from safetensors.torch import save_file

    from dsv4.config import ModelConfig
    from dsv4.model.model import DeepseekV4

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    with torch.device("meta"):
        model = DeepseekV4(ModelConfig.from_dict(CONFIG))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    shard, size, files, weight_map, total = {}, 0, [], {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        for k, t in _tensor(name, shape, g).items():
            shard[k] = t
            size += t.numel() * t.element_size()
        if size >= shard_bytes or i == len(shapes) - 1:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({k: fname for k in shard})
            total += size
            print(f"  {fname}: {size / 1e9:.2f} GB", file=sys.stderr, flush=True)
            shard, size = {}, 0
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}) + "\n")
    print(f"wrote {out}: {total / 1e9:.2f} GB in {len(files)} shards")


# ------------------------------------------------------------------ one arm, in its own process
def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(fn, reps: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _draft_ids(spec: str, vocab: int) -> list[int]:
    """--draft-vocab: a draft vocabulary file, or N = N token ids drawn at random (seed 0; the
    slice has random weights and no tokenizer, so which tokens does not matter for timing)."""
    if spec.isdigit():
        return torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:int(spec)].tolist()
    from dsv4.draft_vocab import read
    return read(spec, vocab)


def _restricted_draft(model, ids: list[int], quantization: str) -> None:
    """The model's draft head rebuilt over `ids` as the loader builds it (restricted, then
    quantised and packed under w8a8)."""
    from dsv4.model import int8pack

    model.draft_head = None
    model.restrict_draft_vocab(ids)
    if quantization.startswith("w8a8"):
        model.quantize_draft_head()
    if quantization == "w8a8":
        model.pack_int8(int8pack.MIN_BYTES)


def arm(model_dir: Path, quantization: str, dtype: str, reps: int, compile: bool = False,
        draft_vocab: str | None = None) -> dict:
    from benchmarks.run import copy_bandwidth
    from dsv4.model import int8pack
    from dsv4.model.loader import load_model
    from dsv4.model.state import Batch

    t0 = time.perf_counter()
    # as the engine loads: w8a8 weights prepacked for oneDNN unless compiled steps are wanted;
    # "w8a8-unpacked": plain int8 through torch._int_mm (the comparison)
    model = load_model(model_dir, dtype=getattr(torch, dtype), quantization=quantization.removesuffix("-unpacked"),
                       pack=not compile and quantization == "w8a8")
    load_s = time.perf_counter() - t0
    packed = int8pack.packed_bytes(model)
    sd = model.state_dict()
    nbytes = {k: t.numel() * t.element_size() for k, t in sd.items()}
    total = sum(nbytes.values())
    outer = nbytes["embed.weight"] + nbytes["head.weight"]
    cfg = model.cfg
    routed = sum(v for k, v in nbytes.items() if ".ffn.experts." in k)
    n_moe = len(model.layers) + (1 if model.has_mtp else 0)
    # one batch-1 main-model step reads: everything but the embedding table, the MTP layer and
    # the unchosen experts (one embedding row; top-k of E experts per layer)
    mtp = sum(v for k, v in nbytes.items() if k.startswith("mtp."))
    mtp_routed = sum(v for k, v in nbytes.items() if k.startswith("mtp.") and ".ffn.experts." in k)
    main_routed = routed - mtp_routed
    step_bytes = (total - nbytes["embed.weight"] - mtp - main_routed
                  + main_routed * cfg.num_experts_per_tok // cfg.n_routed_experts)
    torch.manual_seed(0)
    B, ctx = 4, 64
    state = model.new_state(B + 1, 256, max_chunk=max(ctx, PREFILL))  # the last slot: --compile's scratch
    with torch.inference_mode():
        for s in range(B):
            model.forward_batch(Batch.build([(s, 0, torch.randint(2, cfg.vocab_size, (ctx,)).tolist())]), state)
        last = torch.tensor([0])

        def step(rows: list[tuple[int, int, list[int]]]):
            def run() -> None:  # one dispatch, then rolled back so that it can run again
                model.forward_batch(Batch.build(rows), state, last)
                for s, start, _ in rows:
                    state.rollback(s, start)
            return run

        t1 = _timed(step([(0, ctx, [5])]), reps)
        t4 = _timed(step([(s, ctx, [5]) for s in range(B)]), reps)
        t2 = _timed(step([(0, ctx, [5, 6])]), reps)
        tp = _timed(step([(0, ctx, torch.randint(2, cfg.vocab_size, (PREFILL,)).tolist())]), reps)
        hidden, _ = model.forward_batch(Batch.build([(1, ctx, [5])]), state)
        state.rollback(1, ctx)

        def draft() -> None:  # one MTP draft (its own cache, position 0 of the slot)
            model.mtp_forward(Batch.build([(1, 0, [5])]), hidden, state, last)
            state.rollback(1, ctx, mtp_length=0)

        tm = _timed(draft, reps)
        tm_dv, whole = {}, model.draft_head
        for spec in (draft_vocab or "").split(","):  # the same draft through a draft vocabulary's head
            if spec:
                _restricted_draft(model, _draft_ids(spec, cfg.vocab_size), quantization)
                tm_dv[spec] = _timed(draft, reps)
        model.draft_head = whole  # the compiled steps below: the model as loaded
        comp = _compiled_times(model, state, ctx, B, reps) if compile else {}
    bw = copy_bandwidth("cpu")
    return {"arm": f"{quantization} {dtype}", "load_s": load_s, "weight_bytes": total, "layer_bytes": total - outer,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss": _rss(),
            "step_bytes": step_bytes, "bandwidth": bw, "t1": t1, "t4": t4, "t2": t2, "t_mtp": tm,
            "t_prefill": tp, "routed_bytes": routed, "fp4_backend": _fp4_backend(quantization),
            "t_mtp_dv": tm_dv,
            "n_moe_layers": n_moe, "packed_bytes": packed, **comp}


def _fp4_backend(quantization: str) -> str:
    from dsv4.model import fp4_kernel

    return fp4_kernel.backend() if quantization.endswith("mxfp4") else ""


def load_arm(model_dir: Path, quantization: str, dtype: str) -> dict:
    """Load only (as the engine loads), in a fresh process: seconds, resident weight bytes and
    the peak RSS the load reached (`--load`: run once cold and once on a warm page cache)."""
    from dsv4.model.loader import load_model

    t0 = time.perf_counter()
    model = load_model(model_dir, dtype=getattr(torch, dtype), quantization=quantization)
    load_s = time.perf_counter() - t0
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"arm": f"{quantization} {dtype}", "load_s": load_s, "weight_bytes": total,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss": _rss()}


def _drop_page_cache(model_dir: Path) -> bool:
    """Evict the checkpoint's pages (posix_fadvise DONTNEED on each file): the next load is cold."""
    import os

    for f in sorted(model_dir.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _compiled_times(model, state, ctx: int, B: int, reps: int) -> dict:
    """--compile: the main model's decode buckets 1, 2 and 4 as the engine runs them
    (`CompiledSteps`: AOTInductor packages on a CPU, built into the private cache unless
    cached), timed on the same rows as the eager arm: ct1, ct2, ct4 and the build time."""
    from dsv4.engine.compile.env import private_cache_dir
    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.model.state import Batch

    steps = CompiledSteps(model, state, B, with_mtp=False, cache_dir=private_cache_dir())
    build_s = steps.capture()
    if steps.failed or not all(steps.ready.get(("main", n)) for n in (1, 2, 4)):
        raise RuntimeError(f"compile failed: {steps.failed}")

    def step(rows):
        def run() -> None:
            assert steps.main(Batch.build(rows), None) is not None
            for s, start, _ in rows:
                state.rollback(s, start)
        return run

    return {"ct1": _timed(step([(0, ctx, [5])]), reps), "ct2": _timed(step([(0, ctx, [5, 6])]), reps),
            "ct4": _timed(step([(s, ctx, [5]) for s in range(B)]), reps), "compile_s": build_s,
            "compiled_by": "aoti" if steps.aot else "torch.compile"}


def report(rows: list[dict], accept: float, accept_dv: list[float] | None = None) -> str:
    gib = 2 ** 30
    out = ["| arm | weights GiB (layers) | routed experts GiB | peak RSS GiB | load s | batch 1 tok/s "
           "| batch 4 tok/s | batch 4 / 1 | prefill tok/s | bytes/step GB | floor ms (at GB/s) | of floor "
           "| verify 2 / 1 | MTP draft / step | implied MTP speedup |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_bytes" not in r:  # the transformers arm: batch 1 decode and memory only
            out.append(f"| {r['arm']} | {r['weight_bytes'] / gib:.2f} ({r['layer_bytes'] / gib:.2f}) | - "
                       f"| {r['peak_rss'] / gib:.2f} | {r['load_s']:.0f} | {1 / r['t1']:.2f} | - | - | - | - | - | - "
                       f"| - | - | - |")
            continue
        floor = r["step_bytes"] / r["bandwidth"]
        speed = (1 + accept) / (r["t2"] / r["t1"] + r["t_mtp"] / r["t1"])
        out.append(f"| {r['arm']} | {r['weight_bytes'] / gib:.2f} ({r['layer_bytes'] / gib:.2f}) "
                   f"| {r['routed_bytes'] / gib:.2f} | {r['peak_rss'] / gib:.2f} | {r['load_s']:.0f} "
                   f"| {1 / r['t1']:.2f} | {4 / r['t4']:.2f} | {r['t1'] * 4 / r['t4']:.2f}x "
                   f"| {PREFILL / r['t_prefill']:.1f} | {r['step_bytes'] / 1e9:.2f} | {1e3 * floor:.0f} ({r['bandwidth'] / 1e9:.1f}) "
                   f"| {floor / r['t1']:.0%} | {r['t2'] / r['t1']:.2f} | {r['t_mtp'] / r['t1']:.2f} | {speed:.2f}x |")
    dv = [r for r in rows if r.get("t_mtp_dv")]
    if dv:
        a_dv = [accept] * 99 if accept_dv is None else accept_dv
        out += ["", f"| arm | draft vocabulary | verify 2 / 1 | MTP draft / step | acceptance | implied MTP speedup |",
                "|---|---|---|---|---|---|"]
        for r in dv:
            v = r["t2"] / r["t1"]
            out.append(f"| {r['arm']} | all tokens | {v:.2f} | {r['t_mtp'] / r['t1']:.3f} | {accept:.3f} "
                       f"| {(1 + accept) / (v + r['t_mtp'] / r['t1']):.3f}x |")
            for (spec, t), a in zip(r["t_mtp_dv"].items(), a_dv):
                out.append(f"| {r['arm']} | {spec} | {v:.2f} | {t / r['t1']:.3f} | {a:.3f} "
                           f"| {(1 + a) / (v + t / r['t1']):.3f}x |")
    comp = [r for r in rows if "ct1" in r]
    if comp:
        out += ["", "| arm (--compile) | built in s | batch 1 tok/s | vs eager | batch 4 tok/s | vs eager "
                "| batch 4 / batch 1 | verify 2 / 1 | of floor |", "|---|---|---|---|---|---|---|---|---|"]
        for r in comp:
            floor = r["step_bytes"] / r["bandwidth"]
            out.append(f"| {r['arm']} ({r['compiled_by']}) | {r['compile_s']:.0f} | {1 / r['ct1']:.2f} "
                       f"| {r['t1'] / r['ct1']:.2f}x | {4 / r['ct4']:.2f} | {r['t4'] / r['ct4']:.2f}x "
                       f"| {r['ct1'] * 4 / r['ct4']:.2f}x | {r['ct2'] / r['ct1']:.2f} | {floor / r['ct1']:.0%} |")
    by = {r["arm"].split()[0]: r for r in rows}
    if "none" in by and "w8a8" in by:
        a, b = by["none"], by["w8a8"]
        out.append(f"\nw8a8 / none: layer bytes {b['layer_bytes'] / a['layer_bytes']:.2f}x, "
                   f"decode batch 1 {a['t1'] / b['t1']:.2f}x, batch 4 {a['t4'] / b['t4']:.2f}x "
                   f"(implied MTP speedup at acceptance {accept:.2f})")
    for k in ("mxfp4", "w8a8-mxfp4"):
        if k in by and "w8a8" in by:
            a, b = by["w8a8"], by[k]
            out.append(f"{k} / w8a8: routed expert bytes {b['routed_bytes'] / a['routed_bytes']:.2f}x, "
                       f"decode batch 1 {a['t1'] / b['t1']:.2f}x, batch 4 {a['t4'] / b['t4']:.2f}x, "
                       f"prefill {a['t_prefill'] / b['t_prefill']:.2f}x ({b['fp4_backend']})")
    if "transformers" in by:
        h = by["transformers"]
        for k in ("w8a8", "none"):
            if k in by:
                out.append(f"{k} / transformers: decode batch 1 {h['t1'] / by[k]['t1']:.2f}x, "
                           f"peak RSS {by[k]['peak_rss'] / h['peak_rss']:.2f}x")
    return "\n".join(out)


def load_report(model_dir: Path, arms: list[str]) -> str:
    """Each arm's load cold, then warm (a restart on the page cache the cold one filled)."""
    gib = 2 ** 30
    out = ["| arm | weights GiB | cold load s | warm load s | peak RSS GiB (warm) | peak RSS / weights |",
           "|---|---|---|---|---|---|"]
    rows = {}
    for spec in arms:
        runs = []
        for cold in (True, False):
            if cold:
                _drop_page_cache(model_dir)
            r = subprocess.run([sys.executable, __file__, "--dir", str(model_dir), "--one-load", spec],
                               capture_output=True, text=True)
            if r.returncode != 0:
                runs = None
                out.append(f"| {spec} | failed: {(r.stderr.strip().splitlines() or ['?'])[-1]} |")
                break
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if runs:
            c, w = runs
            rows[spec.split(":")[0]] = w
            out.append(f"| {w['arm']} | {w['weight_bytes'] / gib:.2f} | {c['load_s']:.1f} | {w['load_s']:.1f} "
                       f"| {w['peak_rss'] / gib:.2f} | {w['peak_rss'] / w['weight_bytes']:.2f}x |")
    if "w8a8" in rows:
        for k in ("w8a8-mxfp4", "mxfp4"):
            if k in rows:
                out.append(f"\n{k} / w8a8, warm restart: load {rows[k]['load_s'] / rows['w8a8']['load_s']:.2f}x")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--make", action="store_true")
    ap.add_argument("--arms", default="none:bfloat16,w8a8:bfloat16,transformers:bfloat16",
                    help="QUANTIZATION:DTYPE,... (QUANTIZATION none, w8a8 (prepacked for oneDNN, as the engine "
                         "loads it), w8a8-unpacked (torch._int_mm), or transformers: its DeepseekV4ForCausalLM)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--accept", type=float, default=0.66, help="MTP acceptance (the embedded model's, K = 1)")
    ap.add_argument("--compile", action="store_true",
                    help="also time the main model's compiled decode buckets 1, 2, 4 (built into the cache when cold)")
    ap.add_argument("--draft-vocab", metavar="N|FILE,...",
                    help="also time the MTP draft through draft vocabularies' heads: files from 'dsv4 draft-vocab', "
                         "or N = N random token ids")
    ap.add_argument("--accept-draft-vocab", type=lambda t: [float(x) for x in t.split(",")], metavar="A,...",
                    help="MTP acceptance with each draft vocabulary (benchmarks/draft_vocab.py) [default: --accept]")
    ap.add_argument("--load", action="store_true",
                    help="time loading only: each arm cold (the files' pages evicted first) and warm (a restart)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-load", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one_load:
        print(json.dumps(load_arm(a.dir, *a.one_load.split(":"))))
        return
    if a.load:
        print(load_report(a.dir, a.arms.split(",")))
        return
    if a.make:
        make(a.dir)
        return
    if a.one:
        q, dt = a.one.split(":")
        if q == "transformers":
            from benchmarks.flash_slice_hf import hf_arm

            print(json.dumps(hf_arm(a.dir, dt, a.reps)))
        else:
            print(json.dumps(arm(a.dir, q, dt, a.reps, a.compile, a.draft_vocab)))
        return
    rows = []
    for spec in a.arms.split(","):
        r = subprocess.run([sys.executable, __file__, "--dir", str(a.dir), "--one", spec, "--reps", str(a.reps)]
                           + (["--compile"] if a.compile else [])
                           + (["--draft-vocab", a.draft_vocab] if a.draft_vocab else []), capture_output=True, text=True)
        if r.returncode != 0:
            print(f"arm {spec} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(report(rows, a.accept, a.accept_draft_vocab))


if __name__ == "__main__":
    main()
