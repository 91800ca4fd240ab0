"""Engine configuration: `EngineConfig`, one frozen dataclass validated when it is built.

Validation runs before any weight is read: it reads the checkpoint's `config.json` and
the *headers* of its safetensors files (tensor names only), nothing else. Every CLI
flag maps to one field:

    --model --device --dtype --max-num-seqs --max-model-len --max-num-batched-tokens
    --long-prefill-token-threshold --enable-chunked-prefill/--no-enable-chunked-prefill
    --num-speculative-tokens --seed --profile --quantization --compile/--no-compile

Defaults that depend on the checkpoint are resolved when the config is built, so the
fields of a built config always hold concrete values (except `profile_dir`):

* `dtype` "auto" -> float32 on cpu, bfloat16 on cuda/npu;
* `num_speculative_tokens` None or "auto" -> `speculative_auto` and K = the MTP depth (at most
  3: the state is sized for it, a `SpecPolicy` picks 0..K each step) when the checkpoint has
  MTP weights, else 0;
* `prefill_limit` None -> the model's prefill limit (128 for DeepSeek V4);
* `max_num_batched_tokens` None -> prefill_limit + max_num_seqs * (1 + K), so one full
  prefill chunk fits beside a full batch of decode steps;
* `max_model_len` None -> min(max_position_embeddings, 2048), and in single-dispatch
  mode also at most the single-dispatch limit;
* `quantization` None -> as the checkpoint is stored: "w8a8" for a `dsv4 convert`
  output, else "none".

A config that cannot run raises `EngineConfigError` with a one-line message that names
the flag to change (see docs/serving.md section 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.config import ConfigError, ModelConfig

MAX_SPECULATIVE_TOKENS = 3  # the MTP block applied recurrently: the reference supports 1..3
DEFAULT_MAX_MODEL_LEN = 2048
MTP_PREFIX = "mtp.0."
_DTYPES = ("float32", "bfloat16", "float16")


class EngineConfigError(ValueError):
    """An engine configuration that cannot run; the message names the CLI flag to change."""


@dataclass(frozen=True)
class EngineConfig:
    """Validated engine settings; build with `EngineConfig.create(model=..., **flags)`."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int | str | None = None  # built: the largest K (auto: the K chosen from 0..it)
    speculative_auto: bool | None = None  # built: K chosen per step (`num_speculative_tokens` "auto" or None)
    prefill_limit: int | None = None
    seed: int = 0
    profile_dir: str | None = None
    threads: int | None = None  # torch CPU threads; None = default_threads()
    quantization: str | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_timeout: float = 60.0
    compile: bool = False  # --compile: decode dispatches captured per bucket at startup (engine/compiled.py)
    # Resolved from the checkpoint while validating (not arguments).
    model_config: ModelConfig = field(init=False, repr=False, compare=False)
    has_mtp: bool = field(init=False)
    sampling_defaults: dict = field(init=False, repr=False, compare=False)  # from generation_config.json

    @classmethod
    def create(cls, model: str, **kw: Any) -> "EngineConfig":
        """Resolve defaults and validate; raises `EngineConfigError`."""
        return cls(model=model, **kw)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("model", _check_model_dir(self.model))
        set_("device", _check_device(self.device))
        set_("dtype", _resolve_dtype(self.dtype, self.device))
        _check_int("--max-num-seqs", self.max_num_seqs, minimum=1)
        _check_int("--long-prefill-token-threshold", self.long_prefill_token_threshold, minimum=0,
                   hint="0 = no extra limit")
        _check_int("--seed", self.seed, minimum=0)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise EngineConfigError(f"--enable-chunked-prefill must be true or false, "
                                    f"got {self.enable_chunked_prefill!r}")
        if not isinstance(self.compile, bool):
            raise EngineConfigError(f"--compile must be true or false, got {self.compile!r}")
        if self.profile_dir is not None:
            set_("profile_dir", _check_profile_dir(self.profile_dir))
        if self.threads is None:
            set_("threads", default_threads())
        _check_int("--threads", self.threads, minimum=1)
        set_("sampling_defaults", generation_defaults(Path(self.model)))

        try:
            mc = ModelConfig.from_dir(self.model)
        except ConfigError as e:
            raise EngineConfigError(f"--model {self.model}: {e}") from None
        set_("model_config", mc)
        _check_tensor_parallel(self.tensor_parallel_size, mc, self.device, self.nnodes)
        _check_hosts(self)
        set_("quantization", _resolve_quantization(self.quantization, self.model, self.device))
        names = _weight_names(Path(self.model))
        set_("has_mtp", mc.num_nextn_predict_layers > 0 and any(n.startswith(MTP_PREFIX) for n in names))

        # Speculative decoding.
        k = self.num_speculative_tokens
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        auto = k is None or k == "auto"
        if auto and self.tensor_parallel_size > 1:
            # the ranks replay rank 0's plan with one K: a per-step K is not sent to them (yet)
            if k == "auto":
                raise EngineConfigError("--num-speculative-tokens auto does not work with --tensor-parallel-size "
                                        f"{self.tensor_parallel_size} yet; give a number of drafts (0..3)")
            auto, k = False, min(1, self.mtp_depth)  # the default before auto K
        if auto:
            k = self.mtp_depth  # 0 without MTP weights
        set_("speculative_auto", bool(auto or self.speculative_auto) and self.has_mtp and k > 0)
        _check_int("--num-speculative-tokens", k, minimum=0, hint="or auto")
        if k > MAX_SPECULATIVE_TOKENS:
            raise EngineConfigError(f"--num-speculative-tokens {k} is out of range; "
                                    f"use 0..{MAX_SPECULATIVE_TOKENS} (0 = off)")
        if k > 0 and not self.has_mtp:
            why = ("num_nextn_predict_layers is 0 in its config.json" if mc.num_nextn_predict_layers == 0
                   else f"no '{MTP_PREFIX}*' tensors in its safetensors files")
            raise EngineConfigError(f"--num-speculative-tokens {k} needs MTP weights, but {self.model} has none "
                                    f"({why}); use --num-speculative-tokens 0")
        if k > self.mtp_depth:
            raise EngineConfigError(f"--num-speculative-tokens {k} exceeds the MTP depth {self.mtp_depth} "
                                    f"of this checkpoint; use --num-speculative-tokens {self.mtp_depth} or less")
        set_("num_speculative_tokens", k)

        # Prefill limit and step budget.
        plimit = mc.prefill_limit if self.prefill_limit is None else self.prefill_limit
        _check_int("prefill_limit", plimit, minimum=1)
        if plimit > mc.prefill_limit:
            raise EngineConfigError(f"prefill_limit {plimit} exceeds the prefill limit {mc.prefill_limit} of "
                                    f"deepseek_v4 (the kernel's tile); it may only be lowered "
                                    f"(or use --long-prefill-token-threshold)")
        set_("prefill_limit", plimit)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = plimit + self.max_num_seqs * (1 + k)
        _check_int("--max-num-batched-tokens", budget, minimum=1)
        if self.speculative_auto and budget < 1 + k:  # auto: at most the drafts the budget holds
            k = budget - 1
            set_("num_speculative_tokens", k)
            set_("speculative_auto", k > 0)
        if budget < 1 + k:
            raise EngineConfigError(f"--max-num-batched-tokens {budget} is smaller than one decode step with "
                                    f"{k} speculative tokens (1 + K = {1 + k}); raise --max-num-batched-tokens "
                                    f"to {1 + k} or lower --num-speculative-tokens")
        set_("max_num_batched_tokens", budget)

        # Context length.
        max_pos = mc.max_position_embeddings
        mml = self.max_model_len
        if mml is None:
            mml = min(max_pos, DEFAULT_MAX_MODEL_LEN)
            if self.single_dispatch:
                mml = min(mml, self.single_dispatch_limit)
        _check_int("--max-model-len", mml, minimum=2, hint="one prompt token plus one generated token")
        if mml > max_pos:
            raise EngineConfigError(f"--max-model-len {mml} exceeds the model's max_position_embeddings "
                                    f"{max_pos}; lower --max-model-len to {max_pos}")
        lim = self.single_dispatch_limit
        if self.single_dispatch and mml > lim:
            if self.enable_chunked_prefill:
                raise EngineConfigError(
                    f"speculative decoding needs each prompt in one dispatch on this model (it cannot carry the "
                    f"MTP state across chunks), but max_model_len {mml} exceeds the single-dispatch limit {lim}; "
                    f"use --num-speculative-tokens 0 or lower --max-model-len to {lim}")
            if lim < plimit:
                raise EngineConfigError(
                    f"chunked prefill is disabled, but max_model_len {mml} exceeds the single-dispatch prefill "
                    f"limit {lim} set by --max-num-batched-tokens; enable chunked prefill, raise "
                    f"--max-num-batched-tokens or lower --max-model-len to {lim}")
            raise EngineConfigError(
                f"chunked prefill is disabled, but max_model_len {mml} exceeds the single-dispatch prefill limit "
                f"{lim} of deepseek_v4; enable chunked prefill or lower --max-model-len to {lim}")
        set_("max_model_len", mml)

    # ------------------------------------------------------------------ derived
    @property
    def single_dispatch(self) -> bool:
        """Each prompt must go in one dispatch: chunked prefill is off, or speculation is on
        and the model cannot carry the drafter's state across chunks."""
        spans = self.model_config.speculation_spans_chunks
        return not self.enable_chunked_prefill or (self.num_speculative_tokens > 0 and not spans)

    @property
    def single_dispatch_limit(self) -> int:
        """min(prefill limit, step budget): the longest prompt one dispatch can take."""
        return min(self.prefill_limit, self.max_num_batched_tokens)

    @property
    def effective_chunk_size(self) -> int:
        """The most prompt tokens of one request per step (before this step's budget is spent)."""
        limit = self.single_dispatch_limit
        if not self.single_dispatch and self.long_prefill_token_threshold > 0:
            limit = min(limit, self.long_prefill_token_threshold)
        return limit

    @property
    def mtp_depth(self) -> int:
        """How many drafts the checkpoint supports per step (the MTP block applied recurrently)."""
        return min(MAX_SPECULATIVE_TOKENS, self.model_config.mtp_depth) if self.has_mtp else 0

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def banner_lines(self) -> list[str]:
        """What the startup banner states (docs/serving.md section 2)."""
        return [
            f"device {self.device}"
            + (f" x {self.tensor_parallel_size} ranks (tensor parallel)" if self.tensor_parallel_size > 1 else "")
            + f", dtype {self.dtype}, weights "
            + ("w8a8 (int8 weights per row, int8 activations per token)" if self.quantization == "w8a8"
               else "unquantised"),
            f"model prefill limit {self.model_config.prefill_limit}, "
            f"effective prefill chunk size {self.effective_chunk_size}"
            + (" (single dispatch)" if self.single_dispatch else ""),
            (f"speculative tokens K = auto (0..{self.num_speculative_tokens}, chosen from measured step costs "
             f"and acceptance)" if self.speculative_auto else f"speculative tokens K = {self.num_speculative_tokens}")
            + f" (MTP weights: {'yes' if self.has_mtp else 'no'})",
            f"CPU threads {self.threads}; default sampling "
            + (", ".join(f"{k} {v}" for k, v in self.sampling_defaults.items()) + " (generation_config.json)"
               if self.sampling_defaults else "greedy (no generation_config.json)"),
            "chunked prefill with speculative decoding: "
            + ("supported" if self.model_config.speculation_spans_chunks
               else "not supported by this model (prompts go in one dispatch when K > 0)"),
        ]


# ---------------------------------------------------------------------- defaults
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
MAX_DEFAULT_THREADS = 16


def default_threads() -> int:
    """$OMP_NUM_THREADS when set, else the CPUs this process may run on (its affinity mask,
    so a container's or taskset's limit counts), at most MAX_DEFAULT_THREADS: one decode
    step of a small batch gains little from more, and a thread per core of a shared
    machine oversubscribes it."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_THREADS))


def generation_defaults(model_dir: Path) -> dict:
    """Default sampling parameters from the model's generation_config.json, as vLLM reads it:
    the keys of GENERATION_KEYS that it sets (`do_sample: false` means greedy). Values are
    checked by `SamplingParams.validate` when the engine starts."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EngineConfigError(f"--model {model_dir}: cannot read generation_config.json: {e}") from None
    if not isinstance(raw, dict):
        raise EngineConfigError(f"--model {model_dir}: generation_config.json is not a JSON object")
    out = {k: raw[k] for k in GENERATION_KEYS if raw.get(k) is not None}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


# ---------------------------------------------------------------------- checks
def _check_hosts(c: "EngineConfig") -> None:
    """--nnodes / --node-rank / --master-addr / --master-port / --rendezvous-timeout."""
    _check_int("--nnodes", c.nnodes, minimum=1)
    _check_int("--node-rank", c.node_rank, minimum=0)
    if c.node_rank >= c.nnodes:
        raise EngineConfigError(f"--node-rank {c.node_rank} is out of range for --nnodes {c.nnodes} "
                                f"(use 0..{c.nnodes - 1})")
    if c.tensor_parallel_size % c.nnodes:
        raise EngineConfigError(f"--tensor-parallel-size {c.tensor_parallel_size} is not a multiple of "
                                f"--nnodes {c.nnodes} (each host runs the same number of ranks)")
    if c.nnodes > 1 and (c.master_addr is None or c.master_port is None):
        raise EngineConfigError(f"--nnodes {c.nnodes} needs --master-addr and --master-port "
                                f"(the host of node rank 0 and a free port there)")
    if c.master_port is not None:
        _check_int("--master-port", c.master_port, minimum=1)
        if c.master_port > 65535:
            raise EngineConfigError(f"--master-port {c.master_port} is not a TCP port (1..65535)")
    if not isinstance(c.rendezvous_timeout, (int, float)) or c.rendezvous_timeout <= 0:
        raise EngineConfigError(f"--rendezvous-timeout must be a positive number of seconds, "
                                f"got {c.rendezvous_timeout!r}")


def _check_tensor_parallel(T: Any, mc: ModelConfig, device: str, nnodes: Any = 1) -> None:
    """--tensor-parallel-size: divides every split dimension; one device per rank of a host."""
    from dsv4.model.parallel import ParallelError, check_sizes

    _check_int("--tensor-parallel-size", T, minimum=1)
    try:
        check_sizes(mc, T)
    except ParallelError as e:
        raise EngineConfigError(str(e)) from None
    kind, sep, _ = device.partition(":")
    if T > 1 and sep:
        raise EngineConfigError(f"--tensor-parallel-size {T} gives rank r device {kind}:r; "
                                f"use --device {kind} (not {device})")
    if T > 1 and kind in ("cuda", "npu"):
        import torch

        n = getattr(torch, kind).device_count()
        local = T // nnodes if isinstance(nnodes, int) and nnodes >= 1 and T % nnodes == 0 else T
        if local > n:
            raise EngineConfigError(f"--tensor-parallel-size {T} over --nnodes {nnodes} needs {local} {kind} "
                                    f"devices on each host; {n} are visible")


def _check_int(flag: str, value: Any, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        extra = f" ({hint})" if hint else ""
        raise EngineConfigError(f"{flag} must be {what}{extra}, got {value!r}")


def _check_model_dir(model: Any) -> str:
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise EngineConfigError(f"--model must be a checkpoint directory, got {model!r}")
    p = Path(model).expanduser()
    if not p.exists():
        raise EngineConfigError(f"--model {p}: no such directory")
    if not p.is_dir():
        raise EngineConfigError(f"--model {p} is not a directory; pass the checkpoint directory")
    if not (p / "config.json").is_file():
        raise EngineConfigError(f"--model {p}: no config.json; is this a DeepSeek V4 checkpoint directory?")
    return str(p)


def _check_device(device: Any) -> str:
    if not isinstance(device, str):
        raise EngineConfigError(f"--device must be a string such as cpu, cuda, cuda:0 or npu, got {device!r}")
    kind, sep, idx = device.partition(":")
    if kind not in ("cpu", "cuda", "npu") or (sep and not idx.isdigit()) or (kind == "cpu" and sep):
        raise EngineConfigError(f"--device {device!r} is not supported; use cpu, cuda, cuda:N or npu")
    if kind == "cpu":
        return device
    import torch

    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception as e:  # ImportError, or a broken CANN install
            raise EngineConfigError(f"--device {device} needs the torch_npu package, which failed to import "
                                    f"({type(e).__name__}: {e}); install torch_npu or use --device cpu") from None
        backend = getattr(torch, "npu", None)
    else:
        backend = torch.cuda
    if backend is None or not backend.is_available():
        raise EngineConfigError(f"--device {device}: torch {torch.__version__} sees no {kind} device; "
                                f"use --device cpu")
    if sep and int(idx) >= backend.device_count():
        raise EngineConfigError(f"--device {device}: only {backend.device_count()} {kind} device(s) are visible; "
                                f"use --device {kind}:0")
    return device


def _resolve_dtype(dtype: Any, device: str) -> str:
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in _DTYPES:
        raise EngineConfigError(f"--dtype {dtype!r} is not supported; use auto, {', '.join(_DTYPES)}")
    return dtype


def _resolve_quantization(value: Any, model_dir: str, device: str) -> str:
    """--quantization (None = as stored) against the checkpoint's config.json and the device's kernels."""
    from dsv4.model.checkpoint import QUANTIZATION_KEY, CheckpointError
    from dsv4.model.loader import resolve_quantization

    if value is not None and not isinstance(value, str):
        raise EngineConfigError(f"--quantization must be none or w8a8, got {value!r}")
    try:
        stored = json.loads((Path(model_dir) / "config.json").read_text()).get(QUANTIZATION_KEY, "none")
        q = resolve_quantization(value, str(stored), model_dir)
    except (OSError, ValueError, AttributeError) as e:
        raise EngineConfigError(f"--model {model_dir}: cannot read config.json ({e})") from None
    except CheckpointError as e:
        raise EngineConfigError(str(e)) from None
    if q == "w8a8":
        from dsv4.model.kernels import W8A8Error, check_kernel

        try:
            check_kernel(device)
        except W8A8Error as e:
            raise EngineConfigError(str(e)) from None
    return q


def _check_profile_dir(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise EngineConfigError(f"--profile must be a directory path, got {path!r}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise EngineConfigError(f"--profile {p}: not a directory; create it first")
    if not os.access(p, os.W_OK | os.X_OK):
        raise EngineConfigError(f"--profile {p}: directory is not writable")
    return str(p)


def _weight_names(model_dir: Path) -> set[str]:
    """Tensor names of a checkpoint, from the index or the safetensors headers only."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text()).get("weight_map")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise EngineConfigError(f"--model {model_dir}: cannot read {index.name} ({e})") from None
        if not isinstance(wm, dict):
            raise EngineConfigError(f"--model {model_dir}: {index.name} has no 'weight_map' object")
        return set(wm)
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:  # reads the header only
                names.update(h.keys())
        except Exception as e:  # safetensors raises its own error types
            raise EngineConfigError(f"--model {model_dir}: cannot read the safetensors header of {f.name} "
                                    f"({e})") from None
    return names
