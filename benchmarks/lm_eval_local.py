#!/usr/bin/env python3
"""lm-eval's `local-completions` against a running `dsv4 serve --http`, on a local task.

    dsv4 serve --http 127.0.0.1:8000 --detach
    python benchmarks/lm_eval_local.py --lm-eval /path/to/venv/bin/lm_eval [--base-url URL] [--docs 60]

The task (written to a temporary directory, no hub access): windows of the held-out
Shakespeare texts, a 200-character context and two 60-character continuations, the true one
first and one from elsewhere (multiple choice, accuracy): every choice is a loglikelihood
request (token ids, echo, logprobs, max_tokens 0), the path lm-eval's API models take.
lm-eval is not a dsv4 dependency: install it in its own environment
(`pip install "lm-eval[api]" transformers`).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
from pathlib import Path

import dsv4

ROOT = Path(__file__).resolve().parent.parent
TASK = """task: shakespeare_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", required=True, help="the lm_eval command (of its own environment)")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1/completions")
    ap.add_argument("--model", default="tiny-shakespeare", help="the served model's id (GET /v1/models)")
    ap.add_argument("--docs", type=int, default=60)
    a = ap.parse_args()
    text = "".join(f.read_text(encoding="utf-8") for f in sorted((ROOT / "data/shakespeare/heldout").glob("*.txt")))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "shake.jsonl"
        with data.open("w") as f:
            for _ in range(a.docs):
                i, j = rng.randrange(len(text) - 400), rng.randrange(len(text) - 400)
                f.write(json.dumps({"context": text[i:i + 200],
                                    "choices": [text[i + 200:i + 260], text[j + 200:j + 260]]}) + "\n")
        (Path(d) / "shake.yaml").write_text(TASK.format(data=data))
        args = (f"model={a.model},base_url={a.base_url},tokenizer_backend=huggingface,"
                f"tokenizer={dsv4.DEFAULT_MODEL},num_concurrent=1,max_retries=1")
        subprocess.run([a.lm_eval, "--model", "local-completions", "--model_args", args, "--tasks", "shakespeare_mc",
                        "--include_path", d], check=True, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                              "PATH": "/usr/bin:/bin"})


if __name__ == "__main__":
    main()
