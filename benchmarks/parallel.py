"""Tensor parallelism measured: TTFT, decode tok/s and the share of rank 0's time spent in
collectives (waiting for the other ranks included) at T = 1, 2 (4), one request, greedy.

    python benchmarks/parallel.py [--model DIR] [--sizes 1,2] [--device cpu|cuda]
                                  [--prompt-len 256] [--gen 64] [--reps 3] [--quantization none|w8a8] [--dtype auto|bfloat16]
                                  [--transports object,shm]

On a CPU the ranks share the cores, so T > 1 is slower than T = 1: the point is what the
communication costs. `plan_s_per_step` is rank 0's time sending the plan and the results
of one step, through each plan transport of `--transports` at every T > 1
(`broadcast_object_list` over the group, or the shared-memory channel of
dsv4/engine/parallel/transport.py). With NCCL the collectives are asynchronous, so their time
shows up in the synchronisations after them instead. Prints one JSON line per size and
transport.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from dsv4 import DEFAULT_MODEL, LLM, SamplingParams
from dsv4.model import parallel


def measure(model: str, T: int, transport: str, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    with LLM(model, tensor_parallel_size=T, device=args.device, num_speculative_tokens=0, max_num_seqs=1,
             max_model_len=args.prompt_len + args.gen + 8, quantization=args.quantization, dtype=args.dtype,
             plan_transport=transport) as llm:
        vocab = llm.engine.config.model_config.vocab_size
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        ttft, tpot, share, plan = [], [], [], []
        for _ in range(args.reps):
            parallel.STATS.clear()
            t0 = time.perf_counter()
            (c,) = llm.generate([prompt], SamplingParams(max_tokens=args.gen, ignore_eos=True))
            wall = time.perf_counter() - t0
            ttft.append(c.metrics["timings"]["ttft_s"])
            tpot.append(c.metrics["timings"]["tpot_s"])
            share.append(sum(s for _, s in parallel.STATS.values()) / wall)
            steps = max(1, parallel.STATS.get("broadcast_object", (0, 0.0))[0] // 2)  # plan + results per step
            plan.append(parallel.STATS.get("broadcast_object", (0, 0.0))[1] / steps)
        weights = llm.engine.rank_weight_bytes
    rss = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # rank 0's peak so far, GiB
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"T": T, "transport": transport if T > 1 else None, "device": args.device, "dtype": args.dtype,
            "quantization": args.quantization, "prompt_len": args.prompt_len,
            "gen": args.gen, "ttft_s": med(ttft), "decode_tok_s": 1.0 / med(tpot),
            "collective_share": med(share), "plan_s_per_step": med(plan), "rank_weight_bytes": weights,
            "rank0_peak_rss_gib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--transports", default="object,shm", help="plan transports measured at each T > 1")
    args = ap.parse_args()
    for T in (int(s) for s in args.sizes.split(",")):
        for transport in args.transports.split(",") if T > 1 else ["auto"]:
            print(json.dumps(measure(args.model, T, transport, args)), flush=True)


if __name__ == "__main__":
    main()
