#!/usr/bin/env python3
"""The `transformers:DTYPE` arm of `benchmarks/flash_slice.py`: transformers'
DeepseekV4ForCausalLM (main model, no MTP) on the slice's weights, built on the meta device
and filled tensor by tensor (one copy of the model at any time); resident bytes, peak RSS,
batch-1 decode (a 64-token prefill, then single-token forwards with its cache, greedy).
Run through flash_slice.py (`--arms transformers:bfloat16`), each arm in its own process.
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.flash_slice import _rss


@contextmanager
def _params_on_meta():
    """Construct modules with their parameters on the meta device (buffers stay real), the way
    `accelerate.init_empty_weights(include_buffers=False)` does: no parameter memory, no init."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def hf_arm(model_dir: Path, dtype: str, reps: int) -> dict:
    """transformers' DeepseekV4ForCausalLM on the same weights: built on the meta device, then
    filled tensor by tensor from the checkpoint (each FP8/FP4 weight dequantised straight to
    `dtype`, experts written into their fused slots), so one copy of the model exists at any
    time. Modules transformers keeps in float32 under `from_pretrained(dtype=bfloat16)`
    (`_keep_in_fp32_modules_strict`: norms, mHC, sinks, position biases, router bias) stay float32.
    Decode: a 64-token prefill with its DynamicCache, then single-token forwards (greedy feed,
    K = 0), best of `reps` after one warm-up; the cache cannot be rolled back, so the timed
    steps run at contexts 65, 66, ... (the dsv4 arms time context 64)."""
    import re

    import transformers
    from transformers import DynamicCache

    from dsv4.config import ModelConfig
    from dsv4.model.checkpoint import Checkpoint, dequantize
    from dsv4.model.hf_compat import hf_config_dict, hf_to_official

    t0 = time.perf_counter()
    ck = Checkpoint(model_dir)
    cfg = ModelConfig.from_dict(ck.config)
    with _params_on_meta():
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_config_dict(cfg)))
    hf.eval()
    keep32 = re.compile("|".join(re.escape(m) for m in hf._keep_in_fp32_modules_strict))
    low = getattr(torch, dtype)
    slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}  # hf name -> (module, attr, is_param)
    for mname, mod in hf.named_modules():
        for attr, t in list(mod._parameters.items()) + [(k, v) for k, v in mod._buffers.items()
                                                        if k not in mod._non_persistent_buffers_set]:
            if t is not None:
                slots[f"{mname}.{attr}" if mname else attr] = (mod, attr, attr in mod._parameters)
    back = {next(iter(hf_to_official({n: torch.empty(0)}))): n for n in slots if ".mlp.experts." not in n}

    def target(hname: str) -> torch.Tensor:
        mod, attr, is_param = slots[hname]
        t = getattr(mod, attr)
        if t.is_meta or (t.is_floating_point() and t.dtype != want(hname, t)):
            t = torch.empty(t.shape, dtype=want(hname, t))
            if is_param:
                mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[attr] = t
        return t

    def want(hname: str, t: torch.Tensor) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        return torch.float32 if keep32.search(hname) else low

    filled: set[str] = set()
    inter = cfg.moe_intermediate_size
    with torch.no_grad():
        for name, kind, raw, scale in ck.tensors():
            if name.startswith("mtp."):  # transformers has no MTP block
                continue
            m = re.match(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
            if m:
                i, e, w = m.groups()
                hname = f"model.layers.{i}.mlp.experts." + ("down_proj" if w == "w2" else "gate_up_proj")
                dst = target(hname)[int(e)]
                if w != "w2":
                    dst = dst[:inter] if w == "w1" else dst[inter:]
            else:
                hname = back[name]
                dst = target(hname)
            t = dequantize(kind, raw, scale, dst.dtype) if kind in ("fp8", "fp4") else raw
            dst.copy_(t.view(dst.shape) if t.numel() == dst.numel() else t)
            filled.add(hname)
            del raw, scale, t, dst
    missing = [n for n in slots if n not in filled]
    if missing or any(p.is_meta for p in hf.parameters()):
        raise RuntimeError(f"transformers tensors not filled from the checkpoint: {missing[:5]}")
    load_s = time.perf_counter() - t0
    total = sum(p.numel() * p.element_size() for p in hf.parameters()) + sum(
        b.numel() * b.element_size() for b in hf.buffers())
    outer = sum(t.numel() * t.element_size() for t in (hf.model.embed_tokens.weight, hf.lm_head.weight))
    torch.manual_seed(0)  # a random 64-token context, drawn like the dsv4 arms'
    ctx = 64
    prompt = torch.randint(2, cfg.vocab_size, (ctx,)).tolist()
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t
        tok, pos, times = int(out.logits[0, -1].argmax()), ctx, []
        for _ in range(reps + 1):  # greedy feed: each step's argmax is the next input
            t = time.perf_counter()
            out = hf(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]), cache=cache,
                     use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t)
            tok, pos = int(out.logits[0, -1].argmax()), pos + 1
    return {"arm": f"transformers {dtype}", "load_s": load_s, "weight_bytes": total, "layer_bytes": total - outer,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss": _rss(),
            "t1": min(times[1:]), "t1_steps": times, "prefill_s": prefill_s,
            "transformers": transformers.__version__}
