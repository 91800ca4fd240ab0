#!/usr/bin/env python3
"""`--num-speculative-tokens auto` against every fixed K, as ratios within one run.

    python benchmarks/auto_k.py [--rounds 2] [--prompts 8] [--gen 32] [--threads 1] [--out runs/bench]
    python benchmarks/auto_k.py --tpot [--fresh] [--compile] [--rounds 5] [--gen 64] [--threads 1]
    python benchmarks/auto_k.py --tpot --model SLICE --max-fixed 0 [--rounds 3] [--gen 32] [--threads 2]

One engine per arm (auto, K = 0, 1, 2, 3; embedded model, max_num_seqs 8), built once.
For each round, concurrency (1, 8) and prompt set (256-token windows of the held-out
texts, random token ids), the arms run one after the other in an order that rotates
every round (these machines are shared: alternating spreads the drift over all arms),
each driving every prompt to 32 greedy tokens (EOS ignored). Reported: the best output
tok/s of each arm over the rounds, auto / best fixed K, and which K auto chose (share of
its steps).

`--tpot`: batch 1 instead, the issue's measurement: `--tpot-prompts` 256-token held-out
prompts one after the other (a round's TPOT is their mean; the arms take turns per prompt), `--gen` new tokens, greedy, temperature 0 over the model's generation_config.json (what `dsv4 run
--temperature 0` decodes: greedy with its repetition penalty) and its default sampling;
arms K = 0, 1, 2 (as far as the MTP depth allows) and auto with the CLI's max_num_seqs 8,
interleaved in rotating order for `--rounds` rounds (`--fresh`: a new engine for every
run, as `dsv4 run --local` has). Sampled runs are seeded: the same seeds for every arm of
a round, new ones each round. Reported per arm: median time per output token (TPOT),
auto / best fixed K (as a ratio of medians, and as the median ratio of runs of the same
prompt side by side), the K auto chose per step, its MTP catch-up dispatches, and its
calibrated cost estimates against the ones it ends with.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
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


def count_choices(llm: LLM, holder: dict | None = None) -> dict:
    """Count the K auto's policy picks into `holder["counter"]` (wraps its `choose`; the
    choice itself is unchanged), and append them to `holder["seq"][-1]` when there is one."""
    pol, holder = llm.engine.policy, {"counter": Counter()} if holder is None else holder
    choose = pol.choose

    def counted(batch: int, sampled: int = 0) -> int:
        k = choose(batch, sampled)
        holder["counter"][k] += 1
        if holder.get("seq"):
            holder["seq"][-1].append(k)
        return k

    pol.choose = counted
    return holder


def instrument(llm: LLM, holder: dict, catch: dict) -> None:
    """Count auto's choices (`count_choices`) and its MTP catch-ups (number, pairs, seconds)."""
    count_choices(llm, holder)
    runner = llm.engine.runner
    catch_up = runner._catch_up

    def counted(slot: int, t0: int) -> None:
        catch["n"] += 1
        catch["pairs"] += len(runner.backlog[slot][2])
        t = time.perf_counter()
        catch_up(slot, t0)
        catch["s"] += time.perf_counter() - t

    runner._catch_up = counted


def _seeded(params: SamplingParams, seed: int) -> SamplingParams:
    """`params` with `seed` when they sample (greedy runs need none). Every arm of a round
    draws from the same seeds and every round from new ones: unseeded, each fresh engine
    draws the same text (its generator starts from one seed), so one lucky or unlucky
    sample per arm decided "the best fixed K" in every round."""
    return params if not params.temperature else SamplingParams(**{**params.__dict__, "seed": seed})


def tpot(a: argparse.Namespace) -> None:
    """Batch-1 TPOT of K = 0, 1, 2 and auto (see the module docstring, `--tpot`)."""
    model = a.model or dsv4.DEFAULT_MODEL
    prompts = heldout_prompts(Tokenizer.from_dir(model), a.data, a.tpot_prompts, 256)
    make = lambda arm: LLM(model, num_speculative_tokens=arm, max_model_len=1024, compile=a.compile)  # noqa: E731
    auto = make("auto")
    depth = auto.engine.config.num_speculative_tokens
    names = ["auto"] + [str(k) for k in range(min(depth, 2, a.max_fixed) + 1)]
    arms = {"auto": auto, **{k: make(int(k)) for k in names[1:]}}
    holder: dict = {"counter": Counter()}
    catch = {"n": 0, "pairs": 0, "s": 0.0}
    instrument(auto, holder, catch)
    calib = {n: dict(getattr(auto.engine.policy, n).points) for n in ("verify", "draft", "verify_host", "draft_host")}
    default = auto.engine.default_params.__dict__
    modes = {"greedy": SamplingParams(max_tokens=a.gen, ignore_eos=True),
             "temperature 0 over generation_config (run --temperature 0)":
                 SamplingParams(**{**default, "temperature": 0.0, "max_tokens": a.gen, "ignore_eos": True}),
             "default sampling": SamplingParams(**{**default, "max_tokens": a.gen, "ignore_eos": True})}
    for llm in arms.values():  # warm-up
        drive(llm, prompts[:1], modes["greedy"], 1)
    res: dict = {}
    for mode, params in modes.items():
        holder["counter"] = Counter()
        seqs: list[list[int]] = []
        holder["seq"] = seqs
        catch.update(n=0, pairs=0, s=0.0)
        pairs: dict[str, list[float]] = {arm: [] for arm in names}  # TPOT by (round, prompt), every arm's
        for r in range(a.rounds):
            tpots: dict[str, list[float]] = {arm: [] for arm in names}
            for i, prompt in enumerate(prompts):  # the arms take turns per prompt: drift spreads over all
                turn = r * len(prompts) + i
                for arm in names[turn % len(names):] + names[:turn % len(names)]:
                    if a.fresh:  # a new engine per run, as `dsv4 run --local` has (auto calibrates anew)
                        arms[arm] = make(arm if arm == "auto" else int(arm))
                        if arm == "auto":
                            instrument(arms[arm], holder, catch)
                    if arm == "auto":
                        seqs.append([])
                    tpots[arm].append(drive(arms[arm], [prompt], _seeded(params, 1000 * r + i), 1)["tpot_ms"])
            for arm in names:
                res.setdefault((mode, arm), []).append(sum(tpots[arm]) / len(tpots[arm]))
                pairs[arm].extend(tpots[arm])
        print(f"{mode}: " + ", ".join(f"K={arm} " + "/".join(f"{x:.1f}" for x in res[(mode, arm)]) for arm in names)
              + " ms/token", flush=True)
        med = {arm: statistics.median_high(res[(mode, arm)]) for arm in names}
        fixed = min(names[1:], key=med.__getitem__)
        # the same prompt and seed, run side by side: the median of those ratios is less moved by
        # the machine's drift than the ratio of two medians
        paired = statistics.median_high(f / t for f, t in zip(pairs[fixed], pairs["auto"]))
        cnt = holder["counter"]
        total = sum(cnt.values()) or 1
        print("  median ms/token: " + ", ".join(f"K={arm} {med[arm]:.2f}" for arm in names)
              + f"; auto / best fixed (K = {fixed}), in speed: {med[fixed] / med['auto']:.3f}x, "
              f"paired {paired:.3f}x (median of {len(pairs['auto'])} runs side by side)")
        print("  auto chose " + ", ".join(f"K={k}: {100 * n / total:.0f}%" for k, n in sorted(cnt.items()))
              + f" of {total} steps; catch-ups {catch['n']} over {catch['pairs']} pairs, {1e3 * catch['s']:.1f} ms; "
              f"K by step (first round): {''.join(map(str, seqs[0][:80]))}", flush=True)
        pol = arms["auto"].engine.policy  # the last auto engine of this mode
        print("  its estimates at the end: " + ", ".join(f"K={k} {pol.throughput(1, k):.0f} tok/s"
                                                         for k in range(pol.max_k + 1))
              + f"; acceptance greedy {', '.join(f'{x:.2f}' for x in pol.acceptance_of(False))}, sampled "
              f"{', '.join(f'{x:.2f}' for x in pol.acceptance_of(True))}", flush=True)
    pol = arms["auto"].engine.policy
    fmt = lambda d: ", ".join(f"{n}: {1e3 * s:.2f}" for n, s in sorted(d.items())[:6])  # noqa: E731
    print(f"calibrated (first auto engine): verify ms by tokens {fmt(calib['verify'])}; MTP ms by rows "
          f"{fmt(calib['draft'])}; choosing tokens, by rows {fmt(calib['verify_host'])}; proposing drafts, "
          f"by rows {fmt(calib['draft_host'])}")
    print(f"at the end (last auto engine): verify ms by tokens {fmt(pol.verify.points)}; MTP ms by rows "
          f"{fmt(pol.draft.points)}; choosing tokens {fmt(pol.verify_host.points)}; proposing drafts "
          f"{fmt(pol.draft_host.points)}; overhead {1e3 * pol.overhead:.2f} ms; acceptance "
          f"{', '.join(f'{x:.2f}' for x in pol.acceptance)}"
          + (f"; level (serving / calibration) verify {pol.verify.level:.2f}, MTP {pol.draft.level:.2f}"
             if hasattr(pol.verify, "level") else ""))


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
    ap.add_argument("--tpot", action="store_true", help="batch-1 time per token of K = 0, 1, 2 and auto, greedy and "
                    "default sampling (the issue's measurement); --rounds repetitions, --gen tokens")
    ap.add_argument("--tpot-prompts", type=int, default=1, help="--tpot: held-out prompts a round")
    ap.add_argument("--model", help="--tpot: a model directory instead of the embedded model (e.g. the peer's slice)")
    ap.add_argument("--max-fixed", type=int, default=2, help="--tpot: the fixed arms are K = 0 .. this (at most 2)")
    ap.add_argument("--fresh", action="store_true", help="--tpot: a new engine for every run (as `dsv4 run --local`)")
    ap.add_argument("--compile", action="store_true", help="--tpot: compiled decode steps (LLM(compile=True): "
                    "the cached buckets load, the others build first)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.tpot:
        return tpot(a)
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
