"""Where and how `--compile` compiles: inductor's CPU settings, the private cache, the checks.

On the CPU each bucket compiles with `CPU_OPTIONS` (a C++ wrapper, frozen weights, inductor's
C++ micro-GEMM for every matmul with a weight operand: `_prefer_cpp_gemm`), with oneDNN off
during the compile so the result can be cached. `private_cache_dir()` points
`TORCHINDUCTOR_CACHE_DIR` (and `TRITON_CACHE_DIR`) at `$XDG_CACHE_HOME/dsv4/inductor` (else
`~/.cache/dsv4/inductor`), created 0700 and refused unless ours, private, and below
directories no other user can change (`check_trusted_chain`); `recheck_cache_dir` repeats
the check before every bucket's compile (a failure leaves the remaining buckets eager).
`buckets` are the token counts compiled; `check_backend` refuses a device inductor cannot
compile for; `quiet_capture` keeps torch's deprecation chatter out of the terminal;
`compiler_settings` is what a bucket's torch.compile runs under. Why: docs/compile.md,
'dsv4/engine/compile/env.py'.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Iterator

import torch

from dsv4.private_paths import PathError, cache_home, check_private_dir, check_trusted_chain, ensure_private_cache

# Inductor on the CPU (measured on the embedded model, BENCHMARKS.md "--compile"):
# - cpp_wrapper: the compiled step calls its kernels from C++, not from a generated Python
#   wrapper of about 1,000 small calls a dispatch;
# - freezing: the weights become constants of the program, which lets the GEMM template
#   pack them once, at capture;
# - max_autotune over "CPP,ATEN": each matmul is timed both as inductor's C++ micro-GEMM and as
#   MKL's, and the faster kept. MKL's small-M GEMM is slow here (2 rows cost twice 1 row);
#   the micro-GEMM reads the weight once for every row of a bucket, so a 2-token verify
#   costs about what a 1-token step does. The timings are cached with the compiled code.
# (Autotuning's tables would go to stderr, which `dsv4 run` shares with the user: off.)
CPU_OPTIONS: dict[str, object] = {"cpp_wrapper": True, "freezing": True, "max_autotune": True,
                                  "max_autotune_gemm_backends": "CPP,ATEN", "autotune_num_choices_displayed": 0,
                                  "max_autotune_report_choices_stats": False}


def _prefer_cpp_gemm(choices: list) -> list:
    """Autotuning's choices for one matmul cut to inductor's C++ GEMM where it applies (ATen's
    where it does not), so nothing is timed: timing costs a C++ build a matmul at capture,
    and the C++ GEMM won for 1 and 2 rows wherever both were timed, MKL's lead at 8 rows and
    more being small (figures: docs/compile.md, 'dsv4/engine/compile/env.py')."""
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller

    if not _PREFER["active"]:  # another torch.compile of this process: left alone
        return choices
    cpp = [c for c in choices if isinstance(c, CppTemplateCaller)]
    return cpp[:1] or choices


_PREFER = {"registered": False, "active": False}  # _prefer_cpp_gemm: added to inductor once; on during capture


def _register_prefer_cpp_gemm() -> None:
    if not _PREFER["registered"]:
        from torch._inductor.select_algorithm import add_preprocessing_fn

        add_preprocessing_fn(_prefer_cpp_gemm)
        _PREFER["registered"] = True


class CompileUnavailable(RuntimeError):
    """`--compile` cannot work here (no C++ compiler for inductor, an unsafe cache dir)."""


def buckets(max_tokens: int) -> list[int]:
    """Token-count buckets 1, 2, 4, ... up to the first power of two >= max_tokens."""
    out = [1]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


def private_cache_dir() -> Path:
    """Point inductor's (and triton's) cache at a private per-user directory, created 0700;
    raise `CompileUnavailable` if it exists but is a symlink, not ours or not private
    (the checks of the daemon's socket directory, `dsv4.private_paths.check_private_dir`)."""
    root = cache_home()
    d = root / "dsv4" / "inductor"
    try:
        ensure_private_cache(d, what="compile cache")
    except OSError as e:
        raise CompileUnavailable(f"cannot create the compile cache {root}: {e.strerror}") from None
    except PathError as e:
        raise CompileUnavailable(str(e)) from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    return d


def recheck_cache_dir(d: Path) -> None:
    """Repeat `private_cache_dir`'s checks on `d`, which it returned (without creating
    anything); `CompileUnavailable` when `d`, or a directory above it, is no longer safe."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(d):
        raise CompileUnavailable(f"TORCHINDUCTOR_CACHE_DIR was changed from the checked compile cache {d}")
    try:
        for p in (d.parent, d):
            check_private_dir(p, create=False, what="compile cache", hint="remove it or set XDG_CACHE_HOME")
        check_trusted_chain(d, what="compile cache", hint="set XDG_CACHE_HOME to a directory only you control")
    except PathError as e:
        raise CompileUnavailable(str(e)) from None


def check_backend(device: torch.device) -> None:
    """Raise `CompileUnavailable` when inductor has no compiler for `device`."""
    if device.type == "cpu":
        try:
            from torch._inductor import cpp_builder

            cxx = cpp_builder.get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 (inductor raises its own types for a missing compiler)
            raise CompileUnavailable(f"no C++ compiler for inductor ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not (os.path.isfile(cxx) or any(os.path.isfile(os.path.join(p, cxx))
                                           for p in os.environ.get("PATH", "").split(os.pathsep))):
            raise CompileUnavailable(f"no C++ compiler for inductor ({cxx} not found)")
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        if not pick_vec_isa():  # CPU_OPTIONS' C++ GEMM needs one: every capture would fail (~20 s each)
            raise CompileUnavailable("inductor finds no SIMD instruction set it can use on this CPU "
                                     f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})")
    elif device.type != "cuda":
        raise CompileUnavailable(f"no compile backend for --device {device.type}")


@contextlib.contextmanager
def quiet_capture() -> Iterator[None]:
    """Warnings torch raises from inside a compile and that the user can do nothing about
    (inductor's freezing touches the deprecated TypedStorage) stay out of stderr; any
    other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated", category=UserWarning)
        yield


@contextlib.contextmanager
def compiler_settings(cpu: bool) -> Iterator[None]:
    """Inductor's settings while a bucket compiles: on the CPU (`cpu`), CPU_OPTIONS with oneDNN
    off for the compile, so that freezing leaves the matmuls to the GEMM template and MKL
    instead of packing oneDNN weights, which inductor's cache cannot store (the compiled
    program calls MKL or its own kernels either way, never oneDNN)."""
    if not cpu:
        yield
        return
    _register_prefer_cpp_gemm()
    onednn = torch.backends.mkldnn.enabled  # (not mkldnn.flags(): it warns about TF32 each time)
    torch.backends.mkldnn.enabled = False
    _PREFER["active"] = True
    try:
        with torch._inductor.config.patch(CPU_OPTIONS):
            yield
    finally:
        torch.backends.mkldnn.enabled = onednn
        _PREFER["active"] = False
