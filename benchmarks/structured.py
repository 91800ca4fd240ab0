"""The per-token cost of structured-output masking on the embedded model (BENCHMARKS.md,
"Structured outputs").

    .venv/bin/python benchmarks/structured.py [--tokens 128] [--rounds 3] [--k 0,2] [--batch 1,4] [--model DIR]

Per arm: greedy requests on held-out Shakespeare prompts, decode time per output token
(first token to last, prefill excluded) without a constraint (EOS ignored) and with
`json_object` (llguidance; until the grammar ends or --tokens), interleaved over rounds; and
the time spent in the mask itself (`verify.grammar_rows`: filling the bitmasks, applying
them to the logits; `grammar.draft_masks`: the same for the MTP's drafts;
`GrammarState.commit`: the matcher taking the tokens) per token, and the MTP acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dsv4 import LLM, SamplingParams
from dsv4.engine.grammar import masks as G
from dsv4.engine import runner as R
from dsv4.engine.spec import verify as V

PROMPTS = ["HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
           "PROSPERO:\nOur revels now are ended. These our actors,\nAs I foretold you, were all spirits and",
           "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:",
           "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is"]
MASK_S = [0.0]


def _timed(fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            MASK_S[0] += time.perf_counter() - t
    return run


def decode(llm: LLM, params: SamplingParams, batch: int) -> tuple[float, int, float, float | None]:
    """(decode seconds per output token, output tokens, mask seconds per output token, acceptance)
    of one batch."""
    eng = llm.engine
    ids = [eng.add_request(PROMPTS[i % len(PROMPTS)], params) for i in range(batch)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    n: dict[str, int] = dict.fromkeys(ids, 0)
    MASK_S[0] = 0.0
    mask_from = None
    drafted = accepted = 0
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in first:
                first[o.request_id] = now
                mask_from = MASK_S[0] if mask_from is None else mask_from
            else:
                n[o.request_id] += len(o.token_ids)
            last[o.request_id] = now
            if o.finished:
                drafted += o.metrics["spec"]["drafted"]
                accepted += o.metrics["spec"]["accepted"]
    toks = sum(n.values())
    span = max(last.values()) - min(first.values())
    return (span / max(toks, 1) * batch, toks, (MASK_S[0] - (mask_from or 0.0)) / max(toks, 1),
            accepted / drafted if drafted else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", default="0,2")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    a = ap.parse_args()
    V.grammar_rows = _timed(V.grammar_rows)
    R.draft_masks = _timed(R.draft_masks)
    G.GrammarState.commit = _timed(G.GrammarState.commit)
    free = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    json_obj = SamplingParams(max_tokens=a.tokens, structured={"json_object": True})
    print("| K | batch | free ms/token | json_object ms/token | ratio | mask ms/token | json tokens/request "
          "| acceptance free / json |")
    print("|---|---|---|---|---|---|---|---|")
    for k in [int(x) for x in a.k.split(",")]:
        llm = LLM(a.model, num_speculative_tokens=k, max_num_seqs=8)
        for b in [int(x) for x in a.batch.split(",")]:
            decode(llm, json_obj, b)  # warm-up, compiles the grammar once
            fr, js, mask, ntok, acc = [], [], [], [], ([], [])
            for _ in range(a.rounds):
                t, _, _, af = decode(llm, free, b)
                fr.append(t)
                t, n, m, aj = decode(llm, json_obj, b)
                js.append(t)
                mask.append(m)
                ntok.append(n / b)
                acc[0].append(af or 0.0)
                acc[1].append(aj or 0.0)
            f, j = statistics.median(fr), statistics.median(js)
            print(f"| {k} | {b} | {f * 1e3:.2f} | {j * 1e3:.2f} | {j / f:.3f} | "
                  f"{statistics.median(mask) * 1e3:.3f} | {statistics.median(ntok):.0f} | "
                  + (f"{statistics.median(acc[0]):.2f} / {statistics.median(acc[1]):.2f} |" if k else "- |"),
                  flush=True)
        llm.close()


if __name__ == "__main__":
    main()
