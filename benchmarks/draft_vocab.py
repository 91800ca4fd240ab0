#!/usr/bin/env python3
"""MTP acceptance with a draft vocabulary (`dsv4 draft-vocab`, `--draft-vocab`), against every token.

    python benchmarks/draft_vocab.py --data ../shared/data/shakespeare --sizes 4096,2048,1024,512
    python benchmarks/draft_vocab.py --sizes 4096 --match DIR:32320,16160   # DIR: DeepSeek V4's tokenizer.json

For each size, the draft vocabulary of the embedded model is built from the training
texts (`<data>/train/*.txt`, ranked as `dsv4 draft-vocab` ranks them, with the tokenizer's
three special tokens first) and an engine with K = 1
decodes held-out prompts (`<data>/heldout`, 256 tokens each): greedy, and at the
model's default sampling (each prompt with its own seed, the same in every arm, so the
arms sample alike where their drafts do not matter). Prints each size's share of the
vocabulary, its coverage of the held-out text, the acceptance and the mean acceptance
length; the size equal to the vocabulary is the arm without a draft vocabulary. Greedy
text is checked to be the same in every arm (the output never depends on the drafts). A
seeded draw is a function of the target's probabilities alone, but those are computed in
dispatches whose row counts follow acceptance, and float32 sums differ in their last bits
between row counts: a draw that lands on a boundary between two tokens can flip, and the
text diverges from there. The table counts the sampled texts equal to the first arm's.

Two tokenizers split text differently, so a share of one vocabulary is not a share of
another: `--match DIR:N,...` finds, for each set of N tokens of DIR's tokenizer ranked on
the same training texts, the embedded model's set with the same held-out coverage, and
measures it too (how an acceptance measured here stands for a V4 set's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dsv4  # noqa: E402
from benchmarks.run import heldout_prompts  # noqa: E402
from dsv4 import draft_vocab as dv  # noqa: E402
from dsv4.engine.llm import LLM  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.engine.tokenizer import Tokenizer  # noqa: E402


def _texts(folder: Path, tok: Tokenizer) -> list[list[int]]:
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise SystemExit(f"benchmarks/draft_vocab.py: no .txt files in {folder}")
    return [tok.encode(f.read_text(encoding="utf-8")) for f in files]


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict, list[list[int]]]:
    outs = llm.generate(prompts, params)
    spec = [o.metrics["spec"] for o in outs]
    drafted, accepted = sum(s["drafted"] for s in spec), sum(s["accepted"] for s in spec)
    steps = sum(s["verify_steps"] for s in spec)
    return ({"acceptance": accepted / drafted if drafted else float("nan"),
             "length": 1 + accepted / steps if steps else float("nan"), "drafted": drafted},
            [o.token_ids for o in outs])


def _matched(spec: str, data: Path, train: list[list[int]], held: list[list[int]], vocab: int,
             always: list[int]) -> dict[str, int]:
    """--match DIR:N,...: for each N, the held-out coverage of the N most frequent tokens of
    DIR's tokenizer (ranked on the same training texts), and the fewest of the embedded
    model's ranked tokens that cover as much -> {"DIR N (coverage)": embedded size}."""
    from tokenizers import Tokenizer as HF

    where, _, ns = spec.rpartition(":")
    other = HF.from_file(str(Path(where) / "tokenizer.json"))
    enc = lambda folder: [other.encode(f.read_text(encoding="utf-8")).ids  # noqa: E731
                          for f in sorted(folder.glob("*.txt"))]
    o_train, o_held = enc(data / "train"), enc(data / "heldout")
    o_vocab = other.get_vocab_size()
    order = dv.build(train, vocab, vocab, always=always)["token_ids"]
    out = {}
    for n in (int(x) for x in ns.split(",")):
        cov = dv.coverage(dv.build(o_train, o_vocab, n)["token_ids"], o_held)
        lo, hi = 1, vocab  # the coverage of a prefix of `order` grows with its length
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if dv.coverage(order[:mid], held) < cov else (lo, mid)
        out[f"{n} of {o_vocab} ({cov:.1%})"] = lo
        print(f"{n} of {o_vocab} tokens of {where} cover {cov:.1%} of the held-out text; "
              f"the embedded model's {lo} most frequent cover as much", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "shakespeare")
    ap.add_argument("--sizes", default="4096,2048,1024,512")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--match", metavar="DIR:N,...",
                    help="also measure the embedded model's sets matched by held-out coverage to sets of N tokens "
                         "of the tokenizer in DIR (e.g. DeepSeek V4's), ranked on the same training texts")
    a = ap.parse_args()
    model = dsv4.DEFAULT_MODEL
    tok = Tokenizer.from_dir(model)
    train, held = _texts(a.data / "train", tok), _texts(a.data / "heldout", tok)
    prompts = heldout_prompts(tok, a.data, a.prompts, 256)
    probe = LLM(model, num_speculative_tokens=1, draft_vocab="off", max_model_len=1024)
    vocab = probe.engine.config.model_config.vocab_size
    default = probe.engine.default_params.__dict__
    probe.close()
    modes = {"greedy": [SamplingParams(max_tokens=a.gen, ignore_eos=True)] * len(prompts),
             "default sampling": [SamplingParams(**{**default, "max_tokens": a.gen, "ignore_eos": True, "seed": 1000 + i})
                                  for i in range(len(prompts))]}
    always = sorted(set(tok.special_token_ids()))
    sizes = [int(x) for x in a.sizes.split(",")]
    matched = _matched(a.match, a.data, train, held, vocab, always) if a.match else {}
    sizes += [n for n in matched.values() if n not in sizes]
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            if size >= vocab:
                path, cov = "off", 1.0
            else:
                data = dv.build(train, vocab, size, source="train", always=always)
                path = Path(tmp) / f"dv{size}.json"
                path.write_text(json.dumps(data))
                cov = dv.coverage(data["token_ids"], held)
            with LLM(model, num_speculative_tokens=1, draft_vocab=str(path), max_model_len=1024) as llm:
                row = {"size": size, "coverage": cov}
                for mode, params in modes.items():
                    row[mode], out = measure(llm, prompts, params)
                    first = texts.setdefault(mode, out)
                    row[mode]["same"] = sum(a == b for a, b in zip(first, out))
                    if mode == "greedy" and row[mode]["same"] != len(out):
                        raise SystemExit(f"size {size}: greedy output differs from the first arm's")
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print(f"Embedded model ({vocab} tokens), K = 1, {len(prompts)} held-out prompts of 256 tokens, {a.gen} tokens each; "
          f"draft vocabularies from {a.data / 'train'}")
    for name, n in matched.items():
        print(f"Matched by held-out coverage: {name} -> {n} tokens of the embedded model's")
    print("\n| draft vocabulary | of the vocabulary | held-out coverage | greedy acceptance | greedy mean length "
          "| default sampling acceptance | mean length | sampled texts as the first arm's |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        g, s = r["greedy"], r["default sampling"]
        print(f"| {'all tokens' if r['size'] >= vocab else r['size']} | {r['size'] / vocab:.1%} | {r['coverage']:.1%} "
              f"| {g['acceptance']:.3f} | {g['length']:.2f} | {s['acceptance']:.3f} | {s['length']:.2f} "
              f"| {s['same']} of {len(prompts)} |")


if __name__ == "__main__":
    main()
