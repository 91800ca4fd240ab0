"""Compiled decode steps kept on disk (`--compile` warm starts): AOTInductor packages.

A bucket's step (`Step`: the model's `forward_batch` / `mtp_forward` on `Batch.static_step`,
state tensors as inputs mutated in place) is exported and compiled ahead of time into a
package under `<private compile cache>/aoti/<key>.pt2`, which a later start loads with
AOTInductor's C++ loader instead of tracing and compiling. The package holds code, never
weights: those are handed in from the live model at load (`user_managed`, no copy), each
first checked against the name, shape, stride and dtype it was built for. The key is a
sha256 of everything the compiled code depends on (model config, every tensor's name,
shape, stride and dtype, rank and world, kind and bucket, state shapes, torch's version,
the CPU ISA, the source of dsv4/model/*.py), never weight values. A package loads only
from the checked private cache, as a regular file of ours no one else can write, whose
sha256 matches the one written after its build; anything else: one warning line, a rebuild.
Details: docs/compile.md, 'dsv4/engine/compile/artifacts.py'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsv4.model import int8pack, parallel
from dsv4.model.model import DeepseekV4
from dsv4.model.state import Batch, ModelState
from dsv4.private_paths import PathError, check_private_dir

log = logging.getLogger("dsv4.compile")

MODEL_DIR = Path(__file__).resolve().parents[2] / "model"
INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
SMALL_CONSTANT = 1 << 16  # elements: a tensor the model creates while tracing, kept as metadata values


class ArtifactError(RuntimeError):
    """A package that cannot be used (missing, untrusted, stale, corrupt); one line."""


class Step(nn.Module):
    """One bucket's step as a module: forward(ids, pos, slots[, hidden], *state tensors)
    -> (hidden, logits), with the state tensors bound into a shallow copy of `state`."""

    def __init__(self, model: DeepseekV4, state: ModelState, kind: str):
        super().__init__()
        self.model, self.kind = model, kind
        self._state = [state]  # not a submodule: its tensors are inputs, not buffers

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, *rest: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state[0]
        if self.kind == "mtp":
            hidden, *ts = rest
            st = state.rebound(list(ts))
            return self.model.mtp_forward(Batch.static_step(ids, pos, slots, st.static_len), hidden, st)
        st = state.rebound(list(rest))
        return self.model.forward_batch(Batch.static_step(ids, pos, slots, st.static_len), st)


def cpu_isa() -> str:
    """The vector instruction set inductor compiles for on this CPU ('' if none)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return f"{type(isa).__name__}:{isa}" if isa else ""


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """sha256 of dsv4/model/*.py as this process read them (once: polling for packages reads no files)."""
    h = hashlib.sha256()
    for p in sorted(MODEL_DIR.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _sig(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype)]


def _tensor_attrs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds, by attribute path: parameters and buffers (as
    `named_parameters` / `named_buffers` name them, duplicates included) and the tensors
    its modules hold otherwise: attributes, and one level into a dict or plain object
    attribute (`FusedLinear.weight`, the MoE's `stacked["w13"]`)."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        pre = f"{name}." if name else ""
        for k, v in list(mod._parameters.items()) + list(mod._buffers.items()):
            if v is not None:
                out.setdefault(pre + k, v)
        for k, v in vars(mod).items():
            if k.startswith("_") or isinstance(v, nn.Module):
                continue
            inner = v if isinstance(v, dict) else getattr(v, "__dict__", None)
            if isinstance(v, torch.Tensor):
                out.setdefault(pre + k, v)
            elif isinstance(inner, dict):
                for kk, t in inner.items():
                    if isinstance(kk, str) and isinstance(t, torch.Tensor):
                        out.setdefault(f"{pre}{k}.{kk}", t)
    return out


def model_signature(model: DeepseekV4) -> str:
    """What compiled code of `model` depends on, without weight values: its config, the
    name, shape, stride and dtype of every tensor it holds, and for int8 weights on the CPU
    how this process multiplies them (`int8pack.cpu_saturates`: a traced step bakes in the
    split product or the plain one, and oneDNN's ISA can be held lower by ONEDNN_MAX_CPU_ISA
    than inductor's, which `cpu_isa` reads) (sha256 hex)."""
    cfg = model.cfg
    body = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
    attrs = _tensor_attrs(model)
    sig = {k: _sig(v) for k, v in sorted(attrs.items())}
    int8 = model.embed.weight.device.type == "cpu" and any(t.dtype == torch.int8 for t in attrs.values())
    kernel = ("split" if int8pack.cpu_saturates() else "int_mm") if int8 else ""
    return hashlib.sha256(json.dumps([body, sig, kernel], sort_keys=True, default=repr).encode()).hexdigest()


def artifact_key(model: DeepseekV4, state: ModelState, kind: str, n: int, model_sig: str | None = None) -> str:
    """The package's name: sha256 of everything its code depends on (module docstring)."""
    parts = {"model": model_sig or model_signature(model), "kind": kind, "bucket": n,
             "state": [_sig(t) for t in state.tensors()], "max_len": state.max_len, "static_len": state.static_len,
             "rank": parallel.rank(), "world": parallel.world_size(), "torch": torch.__version__,
             "isa": cpu_isa(), "code": _source_hash(), "device": str(model.embed.weight.device.type)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def artifact_dir(cache_dir: Path) -> Path:
    """`<cache_dir>/aoti`, created 0700 and checked like the cache (`ArtifactError` if unsafe)."""
    d = cache_dir / "aoti"
    try:
        check_private_dir(d, create=True, what="compile artifact directory", hint="remove it")
    except PathError as e:
        raise ArtifactError(str(e)) from None
    return d


def example_inputs(step: Step, n: int, scratch: int) -> tuple[torch.Tensor, ...]:
    """Inputs of a bucket of `n` scratch tokens (fresh tensors: export only reads their shapes)."""
    model, state = step.model, step._state[0]
    dev = model.embed.weight.device
    ids = torch.zeros(n, dtype=torch.long, device=dev)
    slots = torch.full((n,), scratch, dtype=torch.long, device=dev)
    extra: tuple[torch.Tensor, ...] = ()
    if step.kind == "mtp":
        extra = (torch.zeros(n, model.cfg.hc_mult, model.cfg.hidden_size, device=dev, dtype=model.embed.weight.dtype),)
    return (ids, ids.clone(), slots, *extra, *state.tensors())


def _check_file(p: Path) -> None:
    """A regular file of ours that nobody else can write (lstat: no symlink)."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise ArtifactError(f"{p.name} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{p} is not a regular file")
    if st.st_uid != os.getuid():
        raise ArtifactError(f"{p} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
    if st.st_mode & 0o022:
        raise ArtifactError(f"{p} has mode {stat.S_IMODE(st.st_mode):04o}, writable by other users")


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_private(p: Path, data: bytes) -> None:
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def build(step: Step, n: int, scratch: int, path: Path, key: str) -> None:
    """Export `step` for a bucket of `n` tokens and compile it into the package `path`,
    then write its sha256 next to it (`path.sha256`). Raises whatever export or inductor
    raise; nothing is left at `path` unless the whole build succeeded."""
    from torch.export.graph_signature import InputKind, InputSpec

    args = example_inputs(step, n, scratch)
    with torch.no_grad(), warnings.catch_warnings():  # torch's own deprecation chatter, not the user's
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
        ep = torch.export.export(step, args, strict=False)
    # The tensors the model holds outside parameters and buffers (fused projections,
    # stacked experts) and those it makes while tracing (small index tables) are lifted
    # as constants; they become named buffers here so that the loader asks for them by
    # a name we can resolve: the live model's attribute path, or const.<i> (a value).
    held = _tensor_attrs(step)
    live = {(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype): name for name, t in held.items()}
    storages = {t.untyped_storage().data_ptr() for t in held.values()}
    values: dict[str, Any] = {}
    specs = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.CONSTANT_TENSOR:
            t = ep.constants.pop(spec.target)
            name = live.get((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype))
            if name is None:  # never a weight's value: that would go stale with other weights
                if t.numel() > SMALL_CONSTANT or t.untyped_storage().data_ptr() in storages:
                    raise ArtifactError(f"the step reads a {tuple(t.shape)} tensor not found among the model's")
                name = f"const.{len(values)}"
                values[name] = [t.tolist(), str(t.dtype).removeprefix("torch.")]
            ep.state_dict[name] = t
            spec = InputSpec(kind=InputKind.BUFFER, arg=spec.arg, target=name, persistent=True)
        specs.append(spec)
    ep.graph_signature.input_specs[:] = specs
    record = {s.target: _sig(ep.state_dict[s.target] if s.target in ep.state_dict else ep.constants[s.target])
              for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    meta = {"dsv4_key": key, "dsv4_torch": torch.__version__, "dsv4_isa": cpu_isa(),
            "dsv4_values": json.dumps(values), "dsv4_consts": json.dumps(record)}
    cfg = dict(INDUCTOR_CONFIGS, **{"aot_inductor.metadata": meta})
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.pt2")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=cfg)
        os.chmod(tmp, 0o600)
        digest = _sha256(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _write_private(path.with_name(path.name + ".sha256"), digest.encode())


class Loaded:
    """A loaded package: `run(*inputs)` -> (hidden, logits), state mutated in place."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, logits = self.loader.run(list(args))
        return h, logits


def load(step: Step, path: Path, key: str) -> Loaded:
    """Load the package `path` after every check of the module docstring, its constants
    bound to the live model's tensors; `ArtifactError` (one line) when it cannot be used."""
    side = path.with_name(path.name + ".sha256")
    _check_file(path)
    _check_file(side)
    if _sha256(path) != side.read_text().strip():
        raise ArtifactError(f"{path.name}: its checksum does not match (truncated or corrupted)")
    AOTI = torch._C._aoti.AOTIModelPackageLoader
    try:
        meta = AOTI.load_metadata_from_package(str(path), "model")
    except Exception as e:  # noqa: BLE001 (a damaged archive: the C++ reader's own error types)
        raise ArtifactError(f"{path.name}: unreadable package ({type(e).__name__})") from None
    for field, want in (("dsv4_key", key), ("dsv4_torch", torch.__version__), ("dsv4_isa", cpu_isa())):
        if meta.get(field) != want:
            raise ArtifactError(f"{path.name} was built for {field.removeprefix('dsv4_')} "
                                f"{meta.get(field)!r}, not {want!r}")
    values = json.loads(meta.get("dsv4_values", "{}"))
    live = _tensor_attrs(step)
    loader = AOTI(str(path), "model", False, 1, -1)
    expected = loader.get_constant_fqns()
    consts: dict[str, torch.Tensor] = {}
    for name in expected:
        if name in values:
            data, dtype = values[name]
            consts[name] = torch.tensor(data, dtype=getattr(torch, dtype), device=step.model.embed.weight.device)
        elif name in live:
            consts[name] = live[name]
        else:
            raise ArtifactError(f"{path.name} needs a tensor {name!r} the model does not have")
    # the shapes, strides and dtypes the code was compiled for are those of the key's model
    # signature; checked again here against the package's own record (the loader does not)
    record = json.loads(meta.get("dsv4_consts", "{}"))
    for name, t in consts.items():
        if name in record and record[name] != _sig(t):
            raise ArtifactError(f"{path.name}: constant {name} is {_sig(t)}, built for {record[name]}")
    loader.load_constants(consts, False, True, True, False)
    return Loaded(loader)


_SIG: dict[int, tuple[nn.Module, str]] = {}  # id(model) -> (model, its signature): computed once


def _key(model: DeepseekV4, state: ModelState, kind: str, n: int) -> str:
    """`artifact_key` with the model's signature computed once per model."""
    held = _SIG.get(id(model))
    if held is None or held[0] is not model:
        held = _SIG[id(model)] = (model, model_signature(model))
    return artifact_key(model, state, kind, n, held[1])


def present(model: DeepseekV4, state: ModelState, kind: str, n: int, cache_dir: Path) -> bool:
    """Whether the bucket's package and its checksum exist (not yet checked: `obtain` does);
    a few stat calls, for polling while a background build runs."""
    path = cache_dir / "aoti" / f"{_key(model, state, kind, n)}.pt2"
    return path.is_file() and path.with_name(path.name + ".sha256").is_file()


def obtain(model: DeepseekV4, state: ModelState, kind: str, n: int, scratch: int, cache_dir: Path,
           build_missing: bool = True) -> tuple[Loaded, bool] | None:
    """The bucket's loaded package and whether it was built now: the cached one when it
    passes every check, else (one warning line naming the reason) a new build, or None
    when `build_missing` is False. Raises when the build or the load of the new package
    fails (the caller compiles otherwise)."""
    key = _key(model, state, kind, n)
    step = Step(model, state, kind)
    path = artifact_dir(cache_dir) / f"{key}.pt2"
    if os.path.lexists(path):
        try:
            return load(step, path, key), False
        except ArtifactError as e:
            log.warning("--compile: the cached %s bucket of %d tokens is not used (%s); %s", kind, n, e,
                        "rebuilding it" if build_missing else "it runs eager until rebuilt")
    if not build_missing:
        return None
    log.info("--compile: building the %s bucket of %d tokens (AOTInductor)", kind, n)
    for p in (path, path.with_name(path.name + ".sha256")):
        if os.path.lexists(p):
            p.unlink()  # our private directory: whatever is in the way goes
    build(step, n, scratch, path, key)
    artifact_dir(cache_dir)  # checked again before loading what was just written
    return load(step, path, key), True
