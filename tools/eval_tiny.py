#!/usr/bin/env python3
"""Measure a model for its card: held-out loss, greedy MTP acceptance, a sample.

    python tools/eval_tiny.py [MODEL_DIR] [--data DIR] [--prompts 16] [--gen 64]

* held-out loss: mean next-token cross entropy (and the MTP block's loss on t+2) over
  consecutive 512-token windows of the held-out texts (main model, full forwards);
* acceptance: the engine generates `--gen` greedy tokens for `--prompts` 256-token
  held-out prompts at K = 1, 2, 3 (acceptance rate, mean acceptance length, and that
  the text equals K = 0);
* a sample continuation of "ROMEO:".
Prints a markdown report.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.engine.tokenizer import Tokenizer
from dsv4.model.loader import load_model
from dsv4.model.state import Batch

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def heldout_loss(model_dir: Path, ids: list[int], seq: int = 512, max_windows: int = 64) -> tuple[float, float]:
    model = load_model(model_dir)
    n = min(max_windows, (len(ids) - 1) // seq)
    step = (len(ids) - seq - 1) // max(n - 1, 1)
    main = mtp = 0.0
    for i in range(n):
        x = torch.tensor([ids[i * step: i * step + seq]])
        hidden, logits = model.forward_batch(Batch.whole(x), None)
        main += F.cross_entropy(logits[:-1], x[0, 1:]).item()
        _, ml = model.mtp_forward(Batch.whole(x[:, 1:-1].contiguous()), hidden[:-2], None)
        mtp += F.cross_entropy(ml, x[0, 2:]).item()
    return main / n, mtp / n


def acceptance(model_dir: Path, prompts: list[list[int]], gen: int) -> dict:
    p = SamplingParams(max_tokens=gen, ignore_eos=True)
    ref = [c.token_ids for c in LLM(model_dir, num_speculative_tokens=0, max_num_seqs=8).generate(prompts, p)]
    out = {}
    for K in (1, 2, 3):
        res = LLM(model_dir, num_speculative_tokens=K, max_num_seqs=8).generate(prompts, p)
        drafted = sum(c.metrics["spec"]["drafted"] for c in res)
        accepted = sum(c.metrics["spec"]["accepted"] for c in res)
        steps = sum(c.metrics["spec"]["verify_steps"] for c in res)
        per_pos = [0.0] * K
        for c in res:
            for i, a in enumerate(c.metrics["spec"]["per_position_acceptance"]):
                per_pos[i] += a / len(res)
        out[K] = {"acceptance_rate": accepted / drafted, "mean_acceptance_length": 1 + accepted / steps,
                  "per_position": per_pos, "same_as_k0": [c.token_ids for c in res] == ref}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", default=dsv4.DEFAULT_MODEL)
    ap.add_argument("--data", type=Path, default=ROOT / "data/shakespeare")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    a = ap.parse_args()
    tok = Tokenizer.from_dir(a.model)
    ids: list[int] = []
    for f in sorted((a.data / "heldout").glob("*.txt")):
        ids += tok.encode(f.read_text(encoding="utf-8")) + [tok.eos_id]
    loss, mtp_loss = heldout_loss(a.model, ids)
    step = (len(ids) - 256) // a.prompts
    prompts = [ids[i * step: i * step + 256] for i in range(a.prompts)]
    acc = acceptance(a.model, prompts, a.gen)
    (sample,) = LLM(a.model).generate(["ROMEO:"], SamplingParams(max_tokens=80))
    print(f"held-out loss (main, next token): {loss:.3f} nats (perplexity {math.exp(loss):.1f})")
    print(f"held-out loss (MTP, token t+2):   {mtp_loss:.3f} nats")
    print(f"\ngreedy acceptance, {a.prompts} held-out prompts of 256 tokens, {a.gen} new tokens each:\n")
    print("| K | acceptance rate | mean acceptance length | per position | output equals K = 0 |")
    print("|---|---|---|---|---|")
    for K, r in acc.items():
        pp = ", ".join(f"{x:.2f}" for x in r["per_position"])
        print(f"| {K} | {r['acceptance_rate']:.3f} | {r['mean_acceptance_length']:.3f} | {pp} | {r['same_as_k0']} |")
    print(f"\nsample (greedy, 80 tokens):\n\nROMEO:{sample.text}")


if __name__ == "__main__":
    main()
