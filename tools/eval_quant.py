#!/usr/bin/env python3
"""Measure --quantization w8a8 against none the way quantisers are judged.

    python tools/eval_quant.py [MODEL_DIR] [--data DIR] [--windows 32] [--seq 512] [--prompts 16] [--gen 64]
    python tools/eval_quant.py MODEL_DIR --random-tokens   # a random model: uniform token ids

Over consecutive held-out windows (full forwards, main model): the mean KL divergence
KL(P_none || P_w8a8) of the next-token distributions, top-1 agreement, and the
perplexity of both. Then greedy MTP acceptance at K = 1 for both (the engine on
`--prompts` held-out prompts of 256 tokens, `--gen` new tokens each), skipped with
`--random-tokens` or `--prompts 0`. Prints a markdown report, and with `--counts` how
the FP4 rows converted (exact / rounded).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.model.loader import load_model
from dsv4.model.w8a8 import RowCounts

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def compare(model_dir: Path, windows: list[list[int]]) -> dict:
    """KL, top-1 agreement and both perplexities over `windows` of token ids."""
    counts = RowCounts()
    ref, q = load_model(model_dir, quantization="none"), load_model(model_dir, quantization="w8a8", counts=counts)
    kl = agree = nll_ref = nll_q = n = 0.0
    for w in windows:
        x = torch.tensor([w])
        lr = F.log_softmax(ref(x)[0, :-1].float(), -1)  # [S-1, V]
        lq = F.log_softmax(q(x)[0, :-1].float(), -1)
        tgt = x[0, 1:]
        kl += (lr.exp() * (lr - lq)).sum().item()
        agree += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
        nll_ref -= lr.gather(1, tgt[:, None]).sum().item()
        nll_q -= lq.gather(1, tgt[:, None]).sum().item()
        n += len(tgt)
    return {"tokens": int(n), "kl": kl / n, "top1": agree / n, "ppl_none": math.exp(nll_ref / n),
            "ppl_w8a8": math.exp(nll_q / n), "counts": counts}


def acceptance(model_dir: Path, prompts: list[list[int]], gen: int, quantization: str) -> float:
    p = SamplingParams(max_tokens=gen, ignore_eos=True)
    res = LLM(model_dir, num_speculative_tokens=1, max_num_seqs=8, quantization=quantization).generate(prompts, p)
    return sum(c.metrics["spec"]["accepted"] for c in res) / sum(c.metrics["spec"]["drafted"] for c in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", default=dsv4.DEFAULT_MODEL)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/shakespeare")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--random-tokens", action="store_true", help="uniform random ids (a random model has no text)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if a.random_tokens:
        from dsv4.config import ModelConfig

        vocab = ModelConfig.from_dir(a.model).vocab_size
        ids = torch.randint(0, vocab, (a.windows * a.seq + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        from dsv4.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(a.model)
        ids = []
        for f in sorted((a.data / "heldout").glob("*.txt")):
            ids += tok.encode(f.read_text(encoding="utf-8")) + [tok.eos_id]
    n = min(a.windows, (len(ids) - 1) // a.seq)
    step = (len(ids) - a.seq - 1) // max(n - 1, 1)
    r = compare(a.model, [ids[i * step: i * step + a.seq] for i in range(n)])
    print(f"model {a.model}: {n} windows of {a.seq} tokens ({r['tokens']} predictions)\n")
    print("| mean KL(none, w8a8) | top-1 agreement | perplexity none | perplexity w8a8 | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {r['kl']:.5f} nats | {100 * r['top1']:.2f} % | {r['ppl_none']:.3f} | {r['ppl_w8a8']:.3f} "
          f"| {r['ppl_w8a8'] / r['ppl_none']:.4f} |")
    print(f"\nFP4 -> int8 rows: {r['counts']}")
    if a.prompts and not a.random_tokens:
        pstep = (len(ids) - 256) // a.prompts
        prompts = [ids[i * pstep: i * pstep + 256] for i in range(a.prompts)]
        acc = {q: acceptance(a.model, prompts, a.gen, q) for q in ("none", "w8a8")}
        print(f"\ngreedy MTP acceptance at K = 1 ({a.prompts} prompts of 256 tokens, {a.gen} new tokens each): "
              f"none {100 * acc['none']:.1f} %, w8a8 {100 * acc['w8a8']:.1f} % "
              f"({100 * (acc['w8a8'] - acc['none']):+.1f} points)")


if __name__ == "__main__":
    main()
