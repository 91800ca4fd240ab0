#!/usr/bin/env python3
"""`--num-speculative-tokens auto` against every fixed K, as ratios within one run.

    python benchmarks/auto_k.py [--rounds 2] [--prompts 8] [--gen 32] [--threads 1] [--out runs/bench]

One engine per arm (auto, K = 0, 1, 2, 3; embedded model, max_num_seqs 8), built once.
For each round, concurrency (1, 8) and prompt set (256-token windows of the held-out
texts, random token ids), the arms run one after the other in an order that rotates
every round (these machines are shared: alternating spreads the drift over all arms),
each driving every prompt to 32 greedy tokens (EOS ignored). Reported: the best output
tok/s of each arm over the rounds, auto / best fixed K, and which K auto chose (share of
its steps).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import dsv4  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.engine.tokenizer import Tokenizer  # noqa: E402
from run import drive, heldout_prompts, machine  # noqa: E402

ARMS = ["auto", "0", "1", "2", "3"]


def count_choices(llm: LLM) -> dict:
    """Count the K auto's policy picks into `holder["counter"]` (wraps its `choose`; the
    choice itself is unchanged)."""
    pol, holder = llm.engine.policy, {"counter": Counter()}
    choose = pol.choose

    def counted(batch: int) -> int:
        k = choose(batch)
        holder["counter"][k] += 1
        return k

    pol.choose = counted
    return holder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/shakespeare")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine, OpenMP barriers of 2 threads stall "
                         "whenever another tenant holds a core)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = dsv4.DEFAULT_MODEL
    tok = Tokenizer.from_dir(model)
    rng = random.Random(0)
    sets = {"held-out": heldout_prompts(tok, a.data, a.prompts, 256),
            "random": [[rng.randrange(2, 4096) for _ in range(256)] for _ in range(a.prompts)]}
    params = SamplingParams(max_tokens=a.gen, ignore_eos=True)
    llms = {arm: LLM(model, num_speculative_tokens=arm, max_num_seqs=8, max_model_len=1024) for arm in ARMS}
    print(f"auto calibrated in {llms['auto'].engine.calibration_s:.2f} s", flush=True)
    for llm in llms.values():
        drive(llm, sets["random"][:2], params, 2)  # warm-up
    best: dict = {}
    choices: dict = {}
    holder = count_choices(llms["auto"])
    for r in range(a.rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
        for c in (1, 8):
            for name, prompts in sets.items():
                for arm in order:
                    holder["counter"] = choices.setdefault((c, name), Counter())
                    res = drive(llms[arm], prompts, params, c)
                    key = (c, name, arm)
                    if key not in best or res["output_tok_s"] > best[key]["output_tok_s"]:
                        best[key] = res
                    print(f"round {r + 1} c={c} {name} K={arm}: {res['output_tok_s']:.1f} tok/s", flush=True)
    m = machine()
    lines = [f"Machine: {m['cpu']} ({m['cores']} threads), torch {m['torch']}, commit {m['commit']}, {m['date']}; "
             f"best of {a.rounds} alternating rounds, {a.prompts} prompts x {a.gen} tokens, {a.threads} thread(s)", "",
             "| concurrency | prompts | auto | K = 0 | K = 1 | K = 2 | K = 3 | auto / best fixed | K auto chose |",
             "|---|---|---|---|---|---|---|---|---|"]
    out = []
    for c in (1, 8):
        for name in sets:
            row = {arm: best[(c, name, arm)]["output_tok_s"] for arm in ARMS}
            fixed = max(ARMS[1:], key=row.__getitem__)
            cnt = choices[(c, name)]
            total = sum(cnt.values()) or 1
            share = ", ".join(f"{k}: {100 * n / total:.0f}%" for k, n in sorted(cnt.items()))
            lines.append(f"| {c} | {name} | " + " | ".join(f"{row[arm]:.1f}" for arm in ARMS)
                         + f" | **{row['auto'] / row[fixed]:.2f}x** (best: K = {fixed}) | {share} |")
            out.append({"concurrency": c, "prompts": name, "tok_s": row, "best_fixed": fixed,
                        "auto_over_best": row["auto"] / row[fixed], "auto_choices": dict(cnt)})
    pol = llms["auto"].engine.policy
    lines += ["", f"auto's estimates at the end: acceptance {', '.join(f'{x:.2f}' for x in pol.acceptance)}; "
              f"verify ms by tokens {', '.join(f'{n}: {1e3 * s:.2f}' for n, s in sorted(pol.verify.points.items()))}; "
              f"MTP ms by rows {', '.join(f'{n}: {1e3 * s:.2f}' for n, s in sorted(pol.draft.points.items())[:8])}"]
    md = "\n".join(lines) + "\n"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "auto_k.md").write_text(md)
    (a.out / "auto_k.json").write_text(json.dumps(out, indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
