"""Fused FP4 GEMMs for the routed experts, from the checkpoint's own layout (no repacking).

    y = linear_a8(xq, xs, packed, scale)   # int8 [M, K], float32 [M, 1] (kernels.quantize_tokens) -> float32 [M, N]
    y = linear_f(x, packed, scale)         # float32 or bfloat16 [M, K] -> [M, N] in x's dtype
    backend()                              # "fp4 GEMM: C++ amx", ... (the startup line)

This module owns the weight format's products, the C++ extension (`csrc/fp4_gemm.cpp`: its
build, loading and choice of path) and the pure-torch fallback. Weight: `packed` [N, K/2]
(element 2k in the low nibble of byte k), `scale` E8M0 [N, K/32], K a multiple of 32.
`linear_a8` is exact, every C++ path and the fallback giving the same bits (per block an
int32 dot product times its power of two, added in block order in float32); `linear_f` is
x @ dequantize_fp4(packed, scale).T within float32 rounding. The path is chosen once per
process (built extension, CPU features, DSV4_FP4_ISA; never compiled at serve time).
Exact contract and edge cases: docs/quantization.md, 'dsv4/model/fp4_kernel.py'.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..private_paths import PathError, check_private_dir, check_trusted_chain
from .quant import dequantize_fp4, e8m0_bytes

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "fp4_gemm.cpp", CSRC / "bf16_gemm.cpp", CSRC / "int8_rows.cpp")  # compiled into one library
HEADERS = (CSRC / "cpu_isa.h",)
NAME = "dsv4_fp4_gemm"
# no fma contraction (the A8 contract is mul, then add); -fopenmp because at::parallel_for is
# an inline `#pragma omp parallel` in torch's OpenMP build: without it the GEMMs run on one thread
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# index = the C++ isa code; "amx": AMX int8 tiles for linear_a8 from 12 rows of x, avx512-vnni's
# kernels below that and for linear_f
ISAS = ("scalar", "avx2", "avx512-vnni", "amx")
BUILD_HINT = "python -m dsv4.model.fp4_kernel --build"
BLOCK = 32
_N_CHUNK = 1024  # output rows per step of the torch fallback (bounds its [B, M, N] int32 sums)

_W2X = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 * e2m1 by nibble


class BuildError(RuntimeError):
    """The extension did not build (one line; the full log is in the build directory)."""


# ----------------------------------------------------------------------------- build and load
def cache_root() -> Path:
    """$XDG_CACHE_HOME/dsv4/ext (else ~/.cache/dsv4/ext): private per-user build outputs."""
    from dsv4.private_paths import cache_home

    return cache_home() / "dsv4" / "ext"


def build_dir() -> Path:
    """This source's build directory, keyed by the source and flags' hash and torch's version."""
    h = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_root() / f"fp4_gemm-{h}-torch{torch.__version__}"


def _check_dir(d: Path, create: bool) -> bool:
    """Refuse (PathError) a build directory that another user could write or repoint; False
    when it is missing (and not `create`)."""
    hint = "remove it or set XDG_CACHE_HOME to a directory only you control"
    for p in (d.parent.parent, d.parent, d):  # .../dsv4, .../dsv4/ext, the build directory
        if not check_private_dir(p, create=create, what="fp4 extension directory", hint=hint):
            return False
    check_trusted_chain(d, what="fp4 extension directory", hint=hint)
    return True


def _load_from(d: Path) -> tuple[object | None, str]:
    """Load `d`/NAME.so: (torch.ops.dsv4_fp4, "") or (None, why not, one line)."""
    try:
        if not _check_dir(d, create=False):
            return None, f"extension not built: run `{BUILD_HINT}`"
        so = d / f"{NAME}.so"
        st = os.lstat(so)
    except FileNotFoundError:
        return None, f"extension not built: run `{BUILD_HINT}`"
    except (PathError, OSError) as e:
        return None, f"extension not loaded: {_one_line(e)}"
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or not os.path.isfile(so):
        return None, f"extension not loaded: {so} is not a file of yours that only you can write"
    try:
        torch.ops.load_library(str(so))
        ops = torch.ops.dsv4_fp4
        ops.cpu_isas()
    except Exception as e:  # noqa: BLE001  (a corrupt or foreign file: OSError, RuntimeError, ...)
        return None, f"extension failed to load ({_one_line(e)}); rebuild with `{BUILD_HINT}`"
    _register_fakes()
    return ops, ""


def _candidates() -> list[Path]:
    """Where this source's build may lie: the cache `build_dir()` names, then the one that the
    virtual environment's set-up recorded (`scripts/venv.sh` writes its path into
    `$VIRTUAL_ENV/.dsv4-fp4-ext`), so that a process started with another XDG_CACHE_HOME still
    finds the extension its set-up built. Only a directory of this very source and torch counts."""
    dirs = [build_dir()]
    try:
        recorded = Path((Path(sys.prefix) / ".dsv4-fp4-ext").read_text().strip()).parent
    except (OSError, ValueError):
        return dirs
    if recorded.is_absolute() and recorded.name == dirs[0].name and recorded != dirs[0]:
        dirs.append(recorded)
    return dirs


@functools.lru_cache(maxsize=1)
def _library() -> tuple[object | None, str]:
    first = None
    for d in _candidates():
        ops, why = _load_from(d)
        if ops is not None:
            return ops, ""
        first = first or why
    return None, first or ""


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (the ops allocate float32 [M, N])."""
    if not hasattr(torch.library, "register_fake"):
        return
    try:
        torch.library.register_fake("dsv4_fp4::linear_a8")(
            lambda xq, xs, packed, scale, isa: xq.new_empty((xq.shape[0], packed.shape[0]), dtype=torch.float32))
        torch.library.register_fake("dsv4_fp4::linear_f")(
            lambda x, packed, scale, isa: x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32))
        torch.library.register_fake("dsv4_fp4::linear_bf16")(
            lambda x, w, isa: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32))
    except RuntimeError:  # registered already (the same library loaded twice)
        pass


def build(verbose: bool = False) -> Path:
    """Compile the extension into `build_dir()` (in a child process, so that this one never
    holds two builds) and return the .so's path; `BuildError` (one line) if it fails."""
    d = build_dir()
    try:
        _check_dir(d, create=True)
    except PathError as e:
        raise BuildError(str(e)) from None
    code = ("import sys, torch.utils.cpp_extension as c; c.load(name=sys.argv[1], sources=sys.argv[3].split(':'), "
            "build_directory=sys.argv[2], extra_cflags=sys.argv[4:], extra_ldflags=['-fopenmp'], is_python_module=False, verbose=True)")
    r = subprocess.run([sys.executable, "-c", code, NAME, str(d), ":".join(map(str, SOURCES)), *CFLAGS],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = d / "build.log"
    log.write_text(r.stdout)
    if verbose:
        print(r.stdout, file=sys.stderr)
    so = d / f"{NAME}.so"
    if r.returncode != 0 or not so.is_file():
        lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else f"exit {r.returncode}")
        raise BuildError(f"{why[:200]} (log: {log})")
    return so


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}"


# ----------------------------------------------------------------------------- choice of path
@functools.lru_cache(maxsize=None)
def _choose(force: str, cap: str) -> tuple[int | None, str]:
    """(C++ isa code or None for the torch fallback, the banner's description)."""
    ops, why = _library()
    if force == "torch":
        return None, "torch fallback (forced by DSV4_FP4_ISA=torch)"
    if ops is None:
        return None, f"torch fallback ({why})"
    mask = int(ops.cpu_isas())
    note = ""
    if force in ISAS and mask >> ISAS.index(force) & 1:
        return ISAS.index(force), f"C++ {force} (forced by DSV4_FP4_ISA)"
    if force:
        note = f" (DSV4_FP4_ISA={force} ignored: this CPU runs {', '.join(available_isas())}, or 'torch')"
    limit = {"default": 0, "avx2": 1}.get(cap.lower(), len(ISAS) - 1)
    best = max(i for i in range(limit + 1) if mask >> i & 1)
    return best, f"C++ {ISAS[best]}{note}"


def _current() -> tuple[int | None, str]:
    return _choose(os.environ.get("DSV4_FP4_ISA", "").strip().lower(), os.environ.get("ATEN_CPU_CAPABILITY", ""))


def backend() -> str:
    """The path this process uses, for the startup banner."""
    return f"fp4 GEMM: {_current()[1]}"


def available_isas() -> list[str]:
    """The C++ paths this CPU can run (empty without the extension), whatever the caps."""
    ops, _ = _library()
    mask = int(ops.cpu_isas()) if ops is not None else 0
    return [name for i, name in enumerate(ISAS) if mask >> i & 1]


@torch.compiler.assume_constant_result
def _current_code() -> int:
    """This process's path as its isa code, -1 for the torch fallback: a constant to
    torch.compile, which calls it once while tracing (it cannot trace the choice's caches)."""
    code = _current()[0]
    return -1 if code is None else code


def isa_code(isa: str | None, *tensors: torch.Tensor) -> int | None:
    """The C++ path's code for an op on `tensors` (None: the torch fallback), `isa` forcing one."""
    if isa is None:
        if not all(t.device.type == "cpu" for t in tensors):
            return None
        code = _current_code()
        return None if code < 0 else code
    if isa == "torch":
        return None
    if isa not in available_isas():
        raise ValueError(f"fp4 GEMM: path {isa!r} is not available here (have: {available_isas() + ['torch']})")
    return ISAS.index(isa)


# ----------------------------------------------------------------------------- checks
def _weight(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an FP4 weight against K activations; return (packed, scale) as uint8 views."""
    shapes = f"packed {tuple(packed.shape)} {packed.dtype}, scale {tuple(scale.shape)} {scale.dtype}"
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"fp4 GEMM: packed must be int8/uint8 [N, K/2]; got {shapes}")
    try:
        s = e8m0_bytes(scale)
    except TypeError:
        raise ValueError(f"fp4 GEMM: scale must be float8_e8m0fnu or uint8 [N, K/32]; got {shapes}") from None
    n, half = packed.shape
    if k % BLOCK or 2 * half != k:
        raise ValueError(f"fp4 GEMM: activations have K = {k}, a multiple of {BLOCK} equal to 2 * packed's "
                         f"{half} columns is needed; got {shapes}")
    if s.dim() != 2 or tuple(s.shape) != (n, k // BLOCK):
        raise ValueError(f"fp4 GEMM: scale must be [{n}, {k // BLOCK}] (one E8M0 per {BLOCK} weights) for K = {k}; "
                         f"got {shapes}")
    if (half > 1 and packed.stride(1) != 1) or (k > BLOCK and s.stride(1) != 1):
        raise ValueError(f"fp4 GEMM: packed and scale need contiguous rows (stride 1 along K); got {shapes} "
                         f"with strides {packed.stride()}, {s.stride()}")
    return packed.view(torch.uint8), s


def _activations(x: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if x.dim() != 2 or x.dtype not in dtypes:
        raise ValueError(f"fp4 GEMM: {what} must be 2-D {'/'.join(str(d) for d in dtypes)} [M, K]; "
                         f"got {tuple(x.shape)} {x.dtype}")


# ----------------------------------------------------------------------------- the products
def linear_a8(xq: torch.Tensor, xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              *, isa: str | None = None) -> torch.Tensor:
    """int8 xq [M, K] with float32 token scales xs [M, 1] -> float32 [M, N] (the exact contract
    in the module docstring). `isa`: force a path ("amx", "avx512-vnni", "avx2", "scalar", "torch")."""
    _activations(xq, (torch.int8,), "xq")
    if xs.dtype != torch.float32 or xs.numel() != xq.shape[0] or xs.dim() not in (1, 2):
        raise ValueError(f"fp4 GEMM: xs must be float32 [M, 1] for xq {tuple(xq.shape)}; got {tuple(xs.shape)} {xs.dtype}")
    p, s = _weight(packed, scale, xq.shape[1])
    code = isa_code(isa, xq, p, s)
    if code is None:
        return _a8_torch(xq, xs.reshape(-1, 1), p, s)
    return torch.ops.dsv4_fp4.linear_a8(xq, xs.reshape(-1), p, s, code)


def linear_f(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """float32/bfloat16 x [M, K] -> x @ dequantize_fp4(packed, scale).T [M, N] in x's dtype
    (computed in float32). `isa`: force a path, as for `linear_a8`."""
    _activations(x, (torch.float32, torch.bfloat16, torch.float16), "x")
    p, s = _weight(packed, scale, x.shape[1])
    code = isa_code(isa, x, p, s)
    x32 = x.float()
    if code is None:
        y = _f_torch(x32, p, s)
    else:
        y = torch.ops.dsv4_fp4.linear_f(x32, p, s, code)
    return y.to(x.dtype)


def linear_bf16(x: torch.Tensor, w: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """float32 x [M, K] @ bfloat16 w [N, K] (the weight as stored, widened as it is read) ->
    float32 [M, N]: x @ w.float().T, every C++ path giving the same bits for a row whatever
    the rows beside it (csrc/bf16_gemm.cpp); the torch fallback within float32 rounding.
    `isa`: force a path, as for `linear_a8` ("amx" runs the AVX-512 one)."""
    _activations(x, (torch.float32,), "x")
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.shape[1] != x.shape[1] or (w.shape[1] > 1 and w.stride(1) != 1):
        raise ValueError(f"bf16 GEMM: w must be bfloat16 [N, {x.shape[1]}] with contiguous rows; "
                         f"got {tuple(w.shape)} {w.dtype}")
    code = isa_code(isa, x, w)
    if code is None:
        return _bf16_torch(x, w)
    return torch.ops.dsv4_fp4.linear_bf16(x, w, code)


# ----------------------------------------------------------------------------- torch fallback
def _bf16_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear_bf16` by float32 matmuls, _N_CHUNK weight rows widened at a time."""
    y = x.new_empty((x.shape[0], w.shape[0]))
    for lo in range(0, w.shape[0], _N_CHUNK):
        torch.mm(x, w[lo:lo + _N_CHUNK].float().t(), out=y[:, lo:lo + _N_CHUNK])
    return y


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(2 * e2m1 as int32 [16], 2^(S - 128) as float32 [256] with S = 255 NaN), on `device`."""
    f = torch.tensor([2.0 ** (s - 128) for s in range(256)], dtype=torch.float64).float()  # exact, denormals too
    f[255] = float("nan")
    return torch.tensor(_W2X, dtype=torch.int32, device=device), f.to(device)


def _a8_torch(xq: torch.Tensor, xs: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The contract spelled out in torch: block sums by integer bmm, then the block-ordered float sums."""
    M, K = xq.shape
    B = K // BLOCK
    w2x, pow2 = _tables(xq.device)
    x = xq.to(torch.int32).view(M, B, BLOCK).permute(1, 0, 2)  # [B, M, 32]
    out = torch.empty(M, p.shape[0], dtype=torch.float32, device=xq.device)
    for n0 in range(0, p.shape[0], _N_CHUNK):
        pc = p[n0:n0 + _N_CHUNK]
        w = torch.stack((w2x[(pc & 15).long()], w2x[(pc >> 4).long()]), dim=-1)  # [n, K/2, 2]
        d = torch.bmm(x, w.view(pc.shape[0], B, BLOCK).permute(1, 2, 0))  # [B, M, n] int32, exact
        f = pow2[s[n0:n0 + _N_CHUNK].long()]  # [n, B]
        acc = torch.zeros(M, pc.shape[0], dtype=torch.float32, device=xq.device)
        for b in range(B):
            acc = acc + d[b].float() * f[:, b]  # two roundings: mul (exact), then add
        out[:, n0:n0 + _N_CHUNK] = acc * xs
    return out


def _f_torch(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Dequantise, then one matrix-vector product per row (so that rows stay independent)."""
    w = dequantize_fp4(p, s)  # float32 [N, K]
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for m in range(x.shape[0]):
        out[m] = torch.mv(w, x[m])
    return out


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.model.fp4_kernel",
                                 description="Build the fp4 GEMM extension, or say which path runs.")
    ap.add_argument("--build", action="store_true", help="compile the C++ extension into the per-user cache")
    ap.add_argument("--stamp", type=Path, help="with --build: write the .so's path here (empty if the build failed)")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    a = ap.parse_args(argv)
    if not a.build:
        print(backend())
        return 0
    try:
        so = build(verbose=a.verbose)
    except BuildError as e:
        print(f"fp4 GEMM: the C++ extension did not build, the torch fallback serves: {e}", file=sys.stderr)
        if a.stamp:
            a.stamp.write_text("")
        return 1
    if a.stamp:
        a.stamp.write_text(str(so))
    print(f"fp4 GEMM: built {so}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
