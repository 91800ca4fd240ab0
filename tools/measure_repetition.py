"""How repetitive is sampled text? Distinct 4-gram ratio over generated tokens, per sampling setting.

    python tools/measure_repetition.py [--model DIR] [--data data/shakespeare] [--prompts 12] [--tokens 256]

For each setting in SETTINGS (greedy, then temperature / top-p / top-k / repetition
penalty combinations) every held-out prompt (64-token windows spread over
data/shakespeare/heldout) generates `--tokens` tokens (EOS ignored, seeded). Reported:

* distinct-4: distinct 4-grams / all 4-grams of each output, averaged (1.0 = no 4-gram
  repeats; a loop like "[Enter X, and X.]" ten times drives it towards 0);
* loops: outputs whose distinct-4 is below 0.5;
* self-NLL: the model's own mean negative log-likelihood (nats) of the generated tokens,
  a coherence proxy: sampling too hot raises it.

Used to choose dsv4/assets/tiny-shakespeare/generation_config.json (see its README).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.engine.tokenizer import Tokenizer
from dsv4.model.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
SETTINGS: list[dict] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.2},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
    {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1},
    {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.2},
    {"temperature": 1.0, "top_p": 1.0},
]


def distinct4(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def prompts_from(data: Path, tok: Tokenizer, n: int, length: int = 64) -> list[list[int]]:
    ids: list[int] = []
    for f in sorted((data / "heldout").glob("*.txt")):
        ids += tok.encode(f.read_text(encoding="utf-8"))
    step = (len(ids) - length) // n
    return [ids[i * step + 997: i * step + 997 + length] for i in range(n)]


@torch.inference_mode()
def self_nll(model, prompt: list[int], out: list[int]) -> float:
    ids = torch.tensor([prompt + out])
    logp = model(ids)[0, :-1].float().log_softmax(-1)  # [S-1, V]
    tgt = ids[0, 1:]
    nll = -logp[torch.arange(len(tgt)), tgt][len(prompt) - 1:]
    return float(nll.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=dsv4.DEFAULT_MODEL)
    ap.add_argument("--data", type=Path, default=ROOT / "data/shakespeare")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    a = ap.parse_args()
    tok = Tokenizer.from_dir(a.model)
    prompts = prompts_from(a.data, tok, a.prompts)
    llm = LLM(a.model, max_num_seqs=len(prompts), max_model_len=64 + a.tokens + 8)
    model = load_model(a.model)
    rows = []
    print(f"{len(prompts)} held-out prompts of 64 tokens, {a.tokens} tokens each, seeds 0..{len(prompts) - 1}")
    print(f"{'setting':<70} {'distinct-4':>10} {'loops':>6} {'self-NLL':>9}")
    for s in SETTINGS:
        params = [SamplingParams(max_tokens=a.tokens, ignore_eos=True, seed=i, **s) for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        d4 = [distinct4(c.token_ids) for c in outs]
        nll = [self_nll(model, p, c.token_ids) for p, c in zip(prompts, outs)]
        row = {"setting": s, "distinct4": sum(d4) / len(d4), "loops": sum(x < 0.5 for x in d4),
               "self_nll": sum(nll) / len(nll)}
        rows.append(row)
        print(f"{json.dumps(s):<70} {row['distinct4']:>10.3f} {row['loops']:>6} {row['self_nll']:>9.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
