#!/usr/bin/env python3
"""Train the embedded default model: a tiny DeepSeek V4 with its MTP block.

Uses dsv4's own model code. Loss = next-token cross entropy of the main model plus
`--mtp-weight` (0.3, as DeepSeek did) times the MTP loss on token t+2, where MTP row
t sees the main model's final streams at t and the token at t+1.

    python tools/train_tiny.py DATA_DIR OUT_DIR [--minutes 50] [--resume]

DATA_DIR holds `train/` and `heldout/` folders of .txt files (the shakespeare data in
shared/data). OUT_DIR gets `ckpt.pt` (resumable: model, optimiser, step, rng) and,
at the end, an asset directory `OUT_DIR/asset` with config.json, model.safetensors
(official names, bf16) and the tokenizer files; copy it to dsv4/assets/<name>/.
The tokenizer is read from --tokenizer (default: dsv4/assets/tiny-shakespeare).
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.engine.tokenizer import Tokenizer
from dsv4.model.save import save_checkpoint
from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.state import Batch

ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 16, 4, 16, 4, 0],
    # the same schedule in transformers' keys (its compress_ratios map knows only 0, 4 and 128)
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 8192,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 32,
    "num_hash_layers": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "moe_intermediate_size": 192,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def load_tokens(folder: Path, tok: Tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for f in sorted(folder.glob("*.txt")):
        ids += tok.encode(f.read_text(encoding="utf-8")) + [tok.eos_id]
    return torch.tensor(ids, dtype=torch.long)


def losses(model: DeepseekV4, x: torch.Tensor, with_mtp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, S] -> (main next-token loss, MTP loss on t+2)."""
    B, S = x.shape
    hidden, logits = model.forward_batch(Batch.whole(x), None)  # [B*S, hc, D], [B*S, V]
    main = F.cross_entropy(logits.view(B, S, -1)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    if not with_mtp:
        return main, torch.zeros(())
    hc, D = hidden.shape[1:]
    h = hidden.view(B, S, hc, D)[:, : S - 2].flatten(0, 1)  # h_t for t in 0..S-3
    _, mlog = model.mtp_forward(Batch.whole(x[:, 1 : S - 1].contiguous()), h, None)  # pairs (h_t, x_{t+1})
    mtp = F.cross_entropy(mlog, x[:, 2:].flatten())
    return main, mtp


@torch.no_grad()
def evaluate(model: DeepseekV4, data: torch.Tensor, seq: int, n: int) -> tuple[float, float]:
    model.eval()
    starts = torch.linspace(0, len(data) - seq - 1, n).long().tolist()
    x = torch.stack([data[s : s + seq] for s in starts])
    main, mtp = losses(model, x)
    model.train()
    return main.item(), mtp.item()


def export(model: DeepseekV4, cfg_dict: dict, tok_dir: Path, out: Path) -> None:
    """The official layout in bf16 (mHC, sinks, ape and router bias stay float32)."""
    save_checkpoint(out, model.state_dict(), cfg_dict, dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "dsv4/assets/tiny-shakespeare")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--minutes", type=float, default=50.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time budget)")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--limit-tokens", type=int, default=0, help="use only this many training tokens")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_dir(a.tokenizer)
    train = load_tokens(a.data / "train", tok)
    held = load_tokens(a.data / "heldout", tok)
    if a.limit_tokens:
        train, held = train[: a.limit_tokens], held[: max(a.limit_tokens // 4, a.seq + 2)]
    print(f"train {len(train)} tokens, held-out {len(held)} tokens", flush=True)
    cfg_dict = dict(TINY_CONFIG, vocab_size=tok.vocab_size)
    cfg = ModelConfig.from_dict(cfg_dict)
    model = init_random(DeepseekV4(cfg), seed=a.seed)
    nparam = sum(p.numel() for p in model.parameters())
    print(f"parameters: {nparam / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    a.out.mkdir(parents=True, exist_ok=True)
    ck = a.out / "ckpt.pt"
    step, elapsed = 0, 0.0
    gen = torch.Generator().manual_seed(a.seed)
    if a.resume and ck.exists():
        s = torch.load(ck, weights_only=False)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        step, elapsed = s["step"], s["elapsed"]
        gen.set_state(s["gen"])
        print(f"resumed at step {step} ({elapsed / 60:.1f} min)", flush=True)
    budget = a.minutes * 60
    model.train()
    t0 = time.time() - elapsed
    while True:
        elapsed = time.time() - t0
        if (a.max_steps and step >= a.max_steps) or (not a.max_steps and elapsed >= budget):
            break
        frac = step / a.max_steps if a.max_steps else elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=gen)
        x = torch.stack([train[s : s + a.seq] for s in starts.tolist()])
        main_loss, mtp_loss = losses(model, x)
        loss = main_loss + a.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            print(f"step {step} t={elapsed / 60:.1f}m lr={lr:.2e} train main {main_loss.item():.3f} "
                  f"mtp {mtp_loss.item():.3f}", flush=True)
        if step % a.eval_every == 0:
            hm, ht = evaluate(model, held, a.seq, 8)
            print(f"step {step} held-out main {hm:.3f} mtp {ht:.3f}", flush=True)
        if step % a.save_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - t0, "gen": gen.get_state()}, ck)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "elapsed": time.time() - t0, "gen": gen.get_state()}, ck)
    hm, ht = evaluate(model, held, a.seq, 16)
    print(f"final step {step}: held-out main loss {hm:.3f} (ppl {math.exp(hm):.1f}), mtp loss {ht:.3f}", flush=True)
    export(model, cfg_dict, a.tokenizer, a.out / "asset")
    print(f"wrote {a.out / 'asset'}", flush=True)


if __name__ == "__main__":
    main()
