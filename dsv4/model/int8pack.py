"""W8A8 weights prepacked for oneDNN's int8 matmul on CPU (eager decode and prefill).

`torch._int_mm` on CPU re-lays a plain int8 weight out for oneDNN on every call; `pack`
does it once, at load (`qlinear_prepack`), and `mm` reads it faster (BENCHMARKS.md, "W8A8
on a DeepSeek V4 Flash-shaped slice"), with the exact int32 products wherever the CPU's
int8 instructions do not saturate: `exact()` checks once per process; packing is off else.

    if int8pack.exact():
        packed = int8pack.pack(w)        # int8 [N, K] -> opaque oneDNN tensor (shape [K, N])
        y = int8pack.mm(xq, packed)      # int8 [M, K] -> float32 [M, N], exact

`pack_model(model)` (the loader's last step, where allowed) packs every int8 weight of at
least `MIN_BYTES` in place; the plain buffers become meta tensors, so a packed model cannot
be saved, moved, sharded or compiled. Details: docs/quantization.md, 'dsv4/model/int8pack.py'.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
from torch import nn

MIN_BYTES = 2 << 20  # smaller weights stay plain: measured 0.85-1.17x at 0.5-1 MiB, 1.1-1.5x at 2 MiB (2 threads)


def available() -> bool:
    """Whether this torch has oneDNN's int8 linear ops."""
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_prepack") \
        and hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """int8 rows [N, K] (cpu) -> oneDNN's prepacked weight (opaque; its `.shape` is [K, N])."""
    return torch.ops.onednn.qlinear_prepack(w.contiguous(), None)


def mm(xq: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Exact int8 [M, K] x packed rows ([K, N] as `pack` made it) -> float32 [M, N] (the int32
    sums as float32)."""
    N = packed.shape[1]
    ones, zeros = _unit_scales(N)
    return torch.ops.onednn.qlinear_pointwise(xq.contiguous(), 1.0, 0, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "")


@functools.lru_cache(maxsize=None)
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int64)


def exact_product(mm_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether `mm_fn(xq [M, K], wq [N, K])` is the exact integer product on this process's
    kernels, checked against int64 on rows of +-127 and alternating signs (oneDNN without
    VNNI sums pairs of u8 x s8 products, the int8 activation shifted by 128, in int16:
    (127 + 128) * 127 twice saturates) and random rows, at 1 and 17 tokens."""
    g = torch.Generator().manual_seed(0)
    K, N = 1024, 72
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    w[0], w[1], w[2, ::2], w[2, 1::2] = 127, -127, 127, -127
    for M in (1, 17):
        x = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g)
        x[0] = 127
        if M > 1:
            x[1], x[2, ::2], x[2, 1::2] = -127, -127, 127
        ref = x.long() @ w.long().t()
        try:
            out = mm_fn(x, w)
        except RuntimeError:  # an op this build lacks at run time
            return False
        same = torch.equal(out.long(), ref) if not out.is_floating_point() else \
            torch.equal(out.double(), ref.float().double())  # float32 output: the exact sums, rounded once
        if not same:
            return False
    return True


@functools.lru_cache(maxsize=1)
def exact() -> bool:
    """Whether packed products are exact on this process's kernels (`exact_product`): VNNI,
    AMX and AVX-512 without VNNI (as oneDNN packs) are; AVX2 and older saturate."""
    return available() and exact_product(lambda x, w: mm(x, pack(w)))


@functools.lru_cache(maxsize=1)
def fast() -> bool:
    """Whether the packed product is not oneDNN's reference kernel here: where oneDNN has no
    optimised int8 matmul for the packed layout on this CPU (seen on an AMD Zen 4 with
    AVX-512 VNNI, oneDNN 3.12: `ref_int8`), packing would make w8a8 far slower (measured:
    docs/quantization.md, 'dsv4/model/int8pack.py'). One probe per process: a [1, 1024] x
    [1024, 1024] product both ways, on one thread (a team of threads beside a busy core, as
    while the daemon loads and its HTTP thread answers, can stall many times over and once
    judged a real kernel slow), best of 6 after two warm-ups; packed must be within 4x of
    the plain one (a real kernel is faster; the reference one is many times slower)."""
    import time

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8, generator=g)
    x = torch.randint(-127, 128, (1, 1024), dtype=torch.int8, generator=g)
    p = pack(w)

    def best(fn: Callable[[], object]) -> float:
        ts = []
        for _ in range(8):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts[2:])

    plain = split_mm if cpu_saturates() else (lambda a, b: torch._int_mm(a, b.t()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(lambda: mm(x, p)) <= 4 * best(lambda: plain(x, w))
    finally:
        torch.set_num_threads(threads)


SATURATES: bool | None = None  # cpu: torch._int_mm's int16 pair sums saturate here (`cpu_saturates`)


def cpu_saturates() -> bool:
    """Whether `torch._int_mm` on this CPU is not the exact product: oneDNN without VNNI
    (AVX2, AVX-512 without VNNI) adds u8 x s8 products in pairs in int16, the int8
    activation shifted by 128, so (127 + 128) * 127 twice saturates; an all-127 row of 4096
    came out as 0.5 M instead of 66 M. Checked once per process (`exact_product`)."""
    global SATURATES
    if SATURATES is None:
        SATURATES = not exact_product(lambda x, w: torch._int_mm(x, w.t()))
    return SATURATES


def split_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The exact int32 product where `torch._int_mm` saturates: wq = a + b with |a| <= 64,
    |b| <= 63, so that no pair sum leaves int16 ((127 + 128) * 64 * 2 = 32640); two products
    (their cost: docs/quantization.md, 'dsv4/model/int8pack.py')."""
    a = wq.clamp(-64, 64)
    return torch._int_mm(xq, a.t()) + torch._int_mm(xq, (wq - a).t())


# oneDNN's CPU ISA levels, lowest first, as ONEDNN_MAX_CPU_ISA names them; the int8 matmul
# runs on the highest the CPU has up to that cap (by the name each level is shown under)
_DNNL_LEVELS = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
                "avx512_core_bf16", "avx512_core_fp16", "avx10_1_512", "avx512_core_amx", "avx512_core_amx_fp16",
                "avx10_1_512_amx", "avx10_1_512_amx_fp16", "all")


def onednn_isa() -> str:
    """The instruction set oneDNN's int8 matmul runs on here: the CPU's best ("AMX",
    "AVX-512 VNNI", "AVX-512", "AVX2"), capped by ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA)."""
    c = torch.cpu
    if c._is_amx_tile_supported():
        best = "avx512_core_amx"
    elif c._is_avx512_supported():
        best = "avx512_core_vnni" if c._is_vnni_supported() else "avx512_core"
    else:
        best = "avx2" if c._is_avx2_supported() else "sse41"
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "all").strip().lower()
    if cap in _DNNL_LEVELS and _DNNL_LEVELS.index(cap) < _DNNL_LEVELS.index(best):
        best = cap
    return {"avx512_core_amx": "AMX", "avx512_core_vnni": "AVX-512 VNNI", "avx512_core": "AVX-512", "avx2": "AVX2",
            "avx2_vnni": "AVX2 VNNI", "avx2_vnni_2": "AVX2 VNNI", "avx": "AVX", "sse41": "SSE4.1"}.get(best, best)


def describe(model: nn.Module) -> str:
    """The startup line for a w8a8 model on the CPU: what was packed (and the instruction set
    oneDNN runs it on), or that products split."""
    n = packed_bytes(model)
    if n:
        return f"w8a8: {n / 2**30:.2f} GiB of int8 weights prepacked for oneDNN's int8 matmul ({onednn_isa()})"
    if available() and exact() and not fast():
        return ("w8a8: int8 weights not prepacked: oneDNN has only its reference int8 matmul for the packed "
                "layout on this CPU (measured ~100x slower); products through torch._int_mm")
    if cpu_saturates():
        return ("w8a8: this CPU's int8 matmul (no VNNI) saturates int16 pair sums, so every int8 product runs as "
                "two that cannot: exact, about twice the int8 work (--quantization none may decode faster here)")
    return ""


def worth_packing(w: torch.Tensor, min_bytes: int) -> bool:
    """Whether a plain int8 weight gets packed: on the CPU and at least `min_bytes`."""
    return w.device.type == "cpu" and w.numel() * w.element_size() >= min_bytes


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of t's shape and dtype: what a packed owner leaves where its plain weight was."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def pack_fused(fused, linears: list[nn.Module], min_bytes: int, packed: torch.Tensor | None = None) -> int:
    """A `fusion.FusedLinear` of int8 `linears` on the CPU: hold its fused weight prepacked
    (`packed`: already packed by the owner of the storage, the MoE's stacked experts) and make
    the linears' plain weights meta. Returns the bytes packed here."""
    w = fused.weight
    if fused.packed or fused.scale is None or not fused.current(linears):
        return 0
    if packed is None and not worth_packing(w, min_bytes):
        return 0
    fused.weight = pack(w) if packed is None else packed
    for m in linears:
        m.weight = meta_like(m.weight)  # a registered buffer of a QuantLinear
    fused.packed = True
    return w.numel() if packed is None else 0


def pack_model(model: nn.Module, min_bytes: int | None = None) -> int:
    """Pack every int8 weight of `model` (CPU, eager) of at least `min_bytes` (None:
    `MIN_BYTES`) in place, each owner its own (`pack_int8` of `QuantLinear`, of the
    `FusedLinear` owners, of `MoE`; a module is visited before its children, so an owner of
    shared storage packs it before its views are seen). Returns the bytes now held packed
    (0 when nothing qualified or this CPU's kernels are not exact)."""
    if not exact():
        return 0
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    packed = 0
    for mod in model.modules():
        fn = getattr(mod, "pack_int8", None)
        if fn is not None:
            packed += fn(min_bytes)
    return packed


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed int8 weights `model` holds: the owners' (`packed_weights`) and
    the fused projections' (`FusedLinear.weight`), each tensor once."""
    seen: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for t in getattr(mod, "packed_weights", lambda: [])():
            seen[id(t)] = t
        fused = getattr(mod, "fused", None)
        if getattr(fused, "packed", False):
            seen[id(fused.weight)] = fused.weight
    return sum(t.numel() * t.element_size() for t in seen.values())
