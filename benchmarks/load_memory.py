"""Memory of `load_model`: peak and settled resident set of a fresh process, against the
parameter bytes it loads.

    python benchmarks/load_memory.py --make DIR            # a random ~0.9 GB (fp32) model, FP8/FP4 on disk
    python benchmarks/load_memory.py DIR [--quantization none|w8a8] [--dtype float32|bfloat16]

Each measurement runs `load_model` in a child process (so nothing else is resident) and
prints one JSON line: parameter bytes, ru_maxrss (peak) and current RSS after loading,
the RSS of the bare interpreter with torch imported, and the FP4 rows converted exactly
or by rounding (w8a8).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A model of ~230 M parameters: mostly FP4 experts, like the real one.
MAKE_CONFIG = dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, head_dim=128,
                   qk_rope_head_dim=32, q_lora_rank=256, o_lora_rank=256, o_groups=4, sliding_window=64,
                   compress_ratios=[0, 4, 16, 4, 0], index_n_heads=4, index_head_dim=64, index_topk=16,
                   moe_intermediate_size=1024, n_routed_experts=16, num_experts_per_tok=2,
                   rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048,
                                 "beta_fast": 32, "beta_slow": 1})

CHILD = r"""
import json, resource, sys, torch
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
base = rss()
from dsv4.model.loader import load_model
kw = {}
if sys.argv[3] != 'default':
    kw['quantization'] = sys.argv[3]
try:
    from dsv4.model.w8a8 import RowCounts
    counts = RowCounts(); kw['counts'] = counts
except ImportError:
    counts = None
m = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]), **kw)
nbytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
print(json.dumps({"param_bytes": nbytes, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss": rss(), "base_rss": base, "fp4_rows": str(counts) if counts is not None else None}))
"""


def make(out: str) -> None:
    import torch

    from dsv4.model.save import save_checkpoint
    from dsv4.model.model import DeepseekV4, init_random
    sys.path.insert(0, str(ROOT))
    from tests.model.tiny import tiny_config, tiny_dict

    cfg = tiny_config(**MAKE_CONFIG)
    model = init_random(DeepseekV4(cfg), seed=0)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    save_checkpoint(out, sd, tiny_dict(**MAKE_CONFIG), quantize=True, dtype=torch.bfloat16, num_shards=2)
    print(f"wrote {out}: {sum(v.numel() for v in sd.values()) / 1e6:.0f} M parameters")


def measure(model_dir: str, dtype: str, quantization: str, pythonpath: str) -> dict:
    env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHILD, model_dir, dtype, quantization], env=env, cwd=pythonpath,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--make", metavar="DIR")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="default")
    p.add_argument("--code", default=str(ROOT), help="source tree to import dsv4 from (compare revisions)")
    a = p.parse_args()
    if a.make:
        make(a.make)
        return
    r = measure(a.model, a.dtype, a.quantization, a.code)
    mib = {k: round(v / 2**20) for k, v in r.items() if isinstance(v, int)}
    print(json.dumps({"dtype": a.dtype, "quantization": a.quantization, **{k + "_mib": v for k, v in mib.items()},
                      "peak_over_params": round(r["peak_rss"] / r["param_bytes"], 2),
                      "rss_over_params": round(r["rss"] / r["param_bytes"], 2), "fp4_rows": r["fp4_rows"]}))


if __name__ == "__main__":
    main()
