"""`load_model`: a DeepSeek V4 checkpoint directory -> a ready `DeepseekV4`.

Order of work, so that the model is never held twice nor in high precision: (1) read
`config.json` and every safetensors header, build the model on the meta device (w8a8:
`QuantLinear`s) and set each tensor's dtype; (2) check the names and shapes the checkpoint
will produce against the model's before any data is read; (3) allocate the model's storage
once on the device and fuse its projections; (4) stream the checkpoint tensor by tensor
(memory mapped), converting each one into its place, every float tensor checked finite and
the hash-routing tables range-checked. Peak memory is the model plus one tensor's
conversion temporaries. Details: docs/quantization.md, 'dsv4/model/loader.py'.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from . import int8pack, kernels, parallel, sharding
from .checkpoint import (_ROUTED_WEIGHT, Checkpoint, CheckpointError, check_tensors, check_tid2eid, dequantize, official_storage,
                         scale_name, validate_tensor)
from .fusion import Source
from .layers import StoredLinear
from .model import DeepseekV4
from .mapped import MappedFiles
from .mxfp4 import FP4Linear, to_mxfp4
from .w8a8 import INT8_MODES, QUANTIZATIONS, QuantLinear, RowCounts, rows_into, to_w8a8


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda[:N]' or 'npu[:N]' -> torch.device, with a clear error when unavailable."""
    d = str(device)
    if d.startswith("npu"):
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise CheckpointError("--device npu needs the torch_npu package (pip install 'dsv4[npu]')") from None
    elif d.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA device is available; use --device cpu")
    return torch.device(d)


def resolve_quantization(requested: str | None, stored: str, where: str) -> str:
    """The format to run: `requested` (None = as the checkpoint is stored). A checkpoint
    already converted to w8a8 runs as w8a8 only. Raises `CheckpointError` naming the flag."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise CheckpointError(f"--quantization {requested!r} is not supported; use {', '.join(QUANTIZATIONS[:-1])} or {QUANTIZATIONS[-1]}")
    if stored not in QUANTIZATIONS:
        raise CheckpointError(f"{where}: config.json records an unknown quantization {stored!r} "
                              f"(supported: {', '.join(QUANTIZATIONS)})")
    if stored == "w8a8" and requested not in (None, "w8a8"):
        raise CheckpointError(f"--quantization {requested}: {where} is a w8a8 conversion (int8 weights); "
                              f"load it with --quantization w8a8 (or none given), or load the original checkpoint")
    return requested or stored


def check_mxfp4(ck: Checkpoint, quantization: str) -> None:
    """An mxfp4 mode keeps the routed experts as the checkpoint stores them: every one must be
    FP4 (I8 packed, E8M0 scales). Raises `CheckpointError` naming the first that is not."""
    if quantization not in ("mxfp4", "w8a8-mxfp4"):
        return
    experts = [n for n in ck.entries if _ROUTED_WEIGHT.fullmatch(n)]
    if not experts:
        raise CheckpointError(f"--quantization {quantization}: {ck.root} has no routed experts")
    for n in sorted(experts):
        if ck.plan.get(n) != "fp4":
            e = ck.entries[n]
            raise CheckpointError(f"--quantization {quantization} keeps the checkpoint's FP4 experts, but {n!r} "
                                  f"is stored as {e.dtype} {list(e.shape)}; use --quantization none or w8a8")


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               quantization: str | None = None, progress: Callable[[int, int], None] | None = None,
               fuse: bool = True, counts: RowCounts | None = None, rank: int = 0, world: int = 1,
               pack: bool = False, draft_vocab: list[int] | None = None) -> DeepseekV4:
    """Load a checkpoint directory (config.json + *.safetensors, official names).

    `quantization`: "none" (weights in `dtype`), "w8a8" (see `w8a8.py`), or None = as the
    checkpoint is stored ("none" for official checkpoints). `fuse` (default) fuses
    linears that read the same input for inference (`DeepseekV4.fuse_projections`): move
    or train the model afterwards only without it. `counts`, if given, receives how the
    FP4 rows converted to int8 (exactly or by rounding). With `world` > 1 the model is
    rank `rank`'s part of the tensor-parallel layout (`sharding.shard_model`) and only
    that part is read from the files; the collectives need `parallel.init` first. `pack`
    (w8a8 on the CPU, one rank): the int8 weights are prepacked for oneDNN's int8 matmul
    where that is exact on this CPU (`int8pack.pack_model`); such a model serves eager only.
    `draft_vocab` (token ids, `draft_vocab.read`): the MTP drafts only these tokens
    (`DeepseekV4.restrict_draft_vocab`)."""
    cfg = ModelConfig.from_dir(path)
    ck = Checkpoint(path)
    quantization = resolve_quantization(quantization, ck.quantization, str(path))
    check_mxfp4(ck, quantization)
    dev = resolve_device(device)
    int8 = quantization in INT8_MODES
    if int8:
        try:
            kernels.check_kernel(dev)
        except kernels.W8A8Error as e:
            raise CheckpointError(str(e)) from None
    with_mtp = cfg.num_nextn_predict_layers > 0 and any(k.startswith("mtp.0.") for k in ck.shapes)
    head = ck.entries.get("head.weight")
    model, layout = meta_model(cfg, quantization, dtype, with_mtp, rank, world,
                               head_stored=head_as_stored(quantization, dtype, dev, lambda: head and head.dtype))
    sd = model.state_dict()
    check_tensors(_produced_shapes(ck, model, layout), {k: tuple(v.shape) for k, v in sd.items()})
    out_of_memory = ""
    try:
        model.to_empty(device=dev)
        files, fused, grouped = MappedFiles(), set(), set()
        maps = layout is None and dev.type == "cpu"  # one rank's whole tensors: the files' pages will do
        if fuse:  # empty storage: the stream below fills the fused tensors, unless they are mapped
            model.fuse_projections(copy=False, source=_fused_source(ck, files, fused, grouped) if maps else None)
        mapped = _map_fp4(model, ck, dev, layout, files)  # the FP4 experts: views of the files' pages
        if maps:
            mapped |= _map_as_stored(model, ck, files, skip=grouped | mapped)
        files.close()
        _stream_into(model, ck, dev, progress, counts if counts is not None else RowCounts(), layout,
                     skip=mapped | fused)
    except (RuntimeError, MemoryError, CheckpointError) as e:
        if "allocate memory" not in str(e) and "out of memory" not in str(e).lower():
            raise
        need = sum(t.numel() * t.element_size() for t in sd.values())
        hint = " or --quantization w8a8" if quantization == "none" else ""
        out_of_memory = (f"out of memory loading {path} on {dev}: its weights need {need / 2**20:.0f} MiB as "
                         f"{quantization} {str(dtype).removeprefix('torch.')}; free memory, use a smaller --dtype{hint}")
    if out_of_memory:  # raised out here, the partial model freed: the caller must still have memory to report it
        del model, sd
        _release_free_memory()
        raise CheckpointError(out_of_memory)
    check_tid2eid(model.state_dict(), cfg.n_routed_experts)
    model.make_rope_tables(dev)
    if draft_vocab is not None and model.has_mtp:
        model.restrict_draft_vocab(draft_vocab, rank, world)
    if int8 and model.has_mtp:
        model.quantize_draft_head()
    if pack and int8 and dev.type == "cpu" and world == 1 and int8pack.fast():  # not onto oneDNN's reference kernel
        int8pack.pack_model(model)
    _release_free_memory()
    return model.eval()


def head_as_stored(quantization: str, dtype: torch.dtype, device: str | torch.device,
                   stored: Callable[[], str | None]) -> bool:
    """Whether the head keeps its stored bfloat16 (`stored()`: the checkpoint's safetensors dtype,
    None: the official format, BF16; asked only where the mode could keep it) where the model
    computes in float32: under the int8 modes
    on the CPU, whose decode step it dominates otherwise (float32 is twice the bytes a token
    reads). `fp4_kernel.linear_bf16` widens each weight as it reads it: the same values as a
    float32 copy, within float32 rounding of its matmul (docs/quantization.md)."""
    return (quantization in INT8_MODES and dtype == torch.float32 and torch.device(device).type == "cpu"
            and stored() in (None, "BF16"))


def meta_model(cfg: ModelConfig, quantization: str, dtype: torch.dtype, with_mtp: bool, rank: int = 0,
               world: int = 1, head_stored: bool = False) -> tuple[DeepseekV4, sharding.Layout | None]:
    """The model as `load_model` holds it (formats, dtypes, rank `rank`'s part of `world`), on
    the meta device: what the weights will be, before any is read (the loader; `memory_plan`).
    `head_stored`: the head stays bfloat16 (`head_as_stored`)."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, with_mtp=with_mtp)
    if quantization.endswith("mxfp4"):
        to_mxfp4(model, act_int8=quantization in INT8_MODES)  # first: to_w8a8 then leaves FP4 experts be
    if quantization in INT8_MODES:
        to_w8a8(model)
    layout = sharding.shard_model(model, rank, world) if world > 1 else None
    _set_dtypes(model, dtype)
    if head_stored:
        StoredLinear.keep(model.head)
    return model, layout


def _set_dtypes(model: DeepseekV4, dtype: torch.dtype) -> None:
    """On the meta model: float tensors in `dtype`, except the official float32 ones and
    the int8 linears' scales (float32); int tensors unchanged."""
    for mod_name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            continue
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            full = f"{mod_name}.{name}" if mod_name else name
            if t.is_floating_point() and not t.is_complex():
                want = torch.float32 if official_storage(full) == "f32" else dtype
                t.data = t.data.to(want)


def _produced_shapes(ck: Checkpoint, model: DeepseekV4, layout: sharding.Layout | None = None
                     ) -> dict[str, tuple[int, ...]]:
    """Names and shapes the streamed checkpoint will fill (only this rank's slices under
    a `layout`): a float weight converted at load time also fills its int8 linear's `scale`."""
    quantized = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    shapes = dict(ck.shapes)
    for n, m in model.named_modules():  # used as stored: the packed bytes and their scales
        if isinstance(m, FP4Linear) and f"{n}.weight" in ck.entries and f"{n}.scale" in ck.entries:
            shapes[f"{n}.weight"], shapes[f"{n}.scale"] = ck.entries[f"{n}.weight"].shape, ck.entries[f"{n}.scale"].shape
    if layout is not None:
        shapes = {n: s for n, s in shapes.items() if layout.holds(n)}
        for n, s in shapes.items():
            if (sh := layout.shard(n)) is not None:
                a, b = sh.bounds(s[sh.dim])
                shapes[n] = s[:sh.dim] + (b - a,) + s[sh.dim + 1:]
    for name, kind in ck.plan.items():
        if name not in shapes:
            continue
        if kind != "int8" and name in quantized:
            shapes[scale_name(name)] = shapes[name][:1]
        if kind == "int8" and name not in quantized:
            raise CheckpointError(f"tensor {name!r} is stored as int8 rows, but the model expects a float weight there")
    return shapes


@torch.no_grad()
def _stream_into(model: DeepseekV4, ck: Checkpoint, dev: torch.device,
                 progress: Callable[[int, int], None] | None, counts: RowCounts,
                 layout: sharding.Layout | None = None, skip: frozenset[str] = frozenset()) -> None:
    """Read every tensor (or this rank's slice of it) once, convert it, copy it into the
    model's storage (fused views included); the names in `skip` are in place already."""
    dest = model.state_dict()  # detached views of the model's own storage
    total = len(ck.plan) if layout is None else sum(layout.holds(n) for n in ck.plan)
    done = sum(n in ck.plan for n in skip)
    for i, (name, kind, raw, scale) in enumerate(ck.tensors(dev, layout, skip=skip), start=done):
        target = dest[name]
        if target.dtype == torch.int8 and kind != "int8":  # convert to int8 rows while loading
            sh = layout.shard(name) if layout is not None else None
            rows_into(kind, raw, scale, target, dest[scale_name(name)], counts,
                      reduce_amax=parallel.all_reduce_max if sh is not None and sh.dim == 1 else None)
        elif kind in ("fp8", "fp4"):
            target.copy_(dequantize(kind, raw, scale, torch.float32))
        else:
            target.copy_(raw)
        _check_finite(name, ck, dest)
        del raw, scale
        if progress is not None:
            progress(i + 1, total)


def _fused_source(ck: Checkpoint, files: MappedFiles, done: set[str], asked: set[str]) -> Source:
    """`fuse_projections`' source on the CPU: a group of tensors that one file stores back to
    back, in the fused order and the model's dtype (as `dsv4 convert` writes them), is used
    as mapped (its names added to `done`, float ones checked finite); None: read and copied.
    Every name asked for goes into `asked` (they live in fused storage, mapped or not)."""
    def source(names: list[str], dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        asked.update(names)
        entries = [ck.entries.get(n) for n in names]
        if any(e is None or ck.plan.get(n) not in ("int8", "plain") for n, e in zip(names, entries)):
            return None
        if len({e.file for e in entries}) != 1 or not _worth_mapping(ck, files, entries[0].file, dtype):
            return None
        flat = files.span(entries[0].file, names, dtype)
        if flat is None or flat.numel() != numel:
            return None
        validate_tensor(names[0], entries[0].file, flat)  # NaN/inf in a mapped float group (row scales)
        done.update(names)
        return flat
    return source


def _worth_mapping(ck: Checkpoint, files: MappedFiles, file: Path, dtype: torch.dtype) -> bool:
    """Whether to use tensors of `file` as its pages: every one of a `dsv4 convert` output
    (its files are the weights), int8 ones, and others only from a file mapped already (a
    private mapping counts whole against RLIMIT_DATA and holds a descriptor: an official
    checkpoint's few float tensors that happen to match are not worth mapping a shard for)."""
    return ck.quantization != "none" or dtype == torch.int8 or files.is_mapped(file)


def _map_as_stored(model: DeepseekV4, ck: Checkpoint, files: MappedFiles, skip: set[str]) -> frozenset[str]:
    """Point every other parameter and buffer the checkpoint stores as the model holds it
    (same dtype and shape, used as stored: int8 from `dsv4 convert`, float tensors in the
    model's dtype) at the file's pages instead of copying it; float ones are checked finite.
    Returns the names filled."""
    done = set()
    tensors = [(mod, attr, t, f"{mod_name}.{attr}" if mod_name else attr) for mod_name, mod in model.named_modules()
               for attr, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]]
    for mod, attr, t, name in sorted(tensors, key=lambda x: x[2].dtype != torch.int8):  # int8 first: they map files
        entry = ck.entries.get(name)
        if (name in skip or entry is None or ck.plan.get(name) not in ("int8", "plain") or t.is_meta
                or not _worth_mapping(ck, files, entry.file, t.dtype)):
            continue
        view = files.span(entry.file, [name], t.dtype)
        if view is None or view.numel() != t.numel():
            continue
        view = view.view(t.shape)
        validate_tensor(name, entry.file, view)
        if isinstance(t, torch.nn.Parameter):
            t.data = view
        else:
            setattr(mod, attr, view)
        done.add(name)
    return frozenset(done)


def _map_fp4(model: DeepseekV4, ck: Checkpoint, dev: torch.device, layout: sharding.Layout | None,
             files: MappedFiles) -> frozenset[str]:
    """Point every `FP4Linear` (of the experts this rank holds) at its packed weight and E8M0
    scales as the files store them (`mapped.MappedFiles`: no copy on the CPU); a scale byte
    of 255 (E8M0's NaN) is a CheckpointError naming the tensor. Returns the names filled."""
    done = set()
    for n, m in model.named_modules():
        if not isinstance(m, FP4Linear) or (layout is not None and not layout.holds(f"{n}.weight")):
            continue
        w, s = (f"{n}.weight", f"{n}.scale")
        packed, scale = files.tensor(ck.entries[w].file, w), files.tensor(ck.entries[s].file, s)
        if bool((scale == 255).any()):
            raise CheckpointError(f"tensor {s!r} in {ck.entries[s].file.name} holds E8M0 NaN scales (255)")
        m.weight, m.scale = packed.view(torch.uint8).to(dev), scale.to(dev)
        done.update((w, s))
    return frozenset(done)


def _check_finite(name: str, ck: Checkpoint, dest: dict[str, torch.Tensor]) -> None:
    """NaN/inf in what `name` just filled (an int8 linear: its row scales, which a
    non-finite weight or block scale makes non-finite) is a CheckpointError."""
    target = dest[name]
    if not target.is_floating_point():
        target = dest.get(scale_name(name), target)
    validate_tensor(name, ck.entries[name].file, target)


def _release_free_memory() -> None:
    """Hand the conversion temporaries' freed heap pages back to the OS (glibc keeps them
    otherwise, and they would count as resident for the life of the process)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
