"""Engine configuration: `EngineConfig`, one frozen dataclass validated when it is built.

Validation runs before any weight is read: it reads the checkpoint's `config.json` and the
*headers* of its safetensors files (tensor names only), nothing else. Every CLI flag of the
engine (--model, --dtype, --max-num-seqs, --max-model-len, --num-speculative-tokens, ...)
maps to one field. Defaults that depend on the checkpoint (model, dtype, K, prefill_limit,
max_num_batched_tokens, max_model_len, kv_cache_blocks, quantization, draft_vocab,
tensor_parallel_size, plan_transport) are resolved when the config is built, so the fields
of a built config always hold concrete values (except `profile_dir`).

A config that cannot run raises `EngineConfigError` with a one-line message that names the
flag to change (docs/serving.md section 2). Every flag and how each default resolves:
docs/serving.md, 'dsv4/engine/config.py'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.config import ConfigError, ModelConfig, block_entry_bytes, state_block_size
from dsv4 import draft_vocab
from dsv4.machine import passive_waiting

from dsv4.engine.checks import (EngineConfigError, check_device, check_hosts, check_int, check_model_dir, check_profile_dir,
                     check_tensor_parallel, machine_memory, parse_memory, resolve_dtype, resolve_quantization,
                     weight_names, check_data_parallel, check_data_parallel_hosts, check_replicas, usable_cpus)
from dsv4.engine.parallel.launch import Launch, resolve_tensor_parallel, resolve_transport, torchrun_launch

QUANTIZATION_LINES = {  # the banner's words for each --quantization
    "none": "unquantised",
    "w8a8": "w8a8 (int8 weights per row, int8 activations per token)",
    "mxfp4": "mxfp4 (routed experts as stored: FP4 with E8M0 scales per 32, float activations; the rest unquantised)",
    "w8a8-mxfp4": "w8a8-mxfp4 (routed experts as stored: FP4 with E8M0 scales per 32; int8 activations per token, "
                  "the other linears int8 per row)",
}
# The prefill chunk where no kernel limits it (CPU, CUDA): chosen on the V4 Flash-shaped slice
# (BENCHMARKS.md, "Prefill chunk"); the step budget is this plus a full batch of decode rows
DEFAULT_CHUNK = 512
MAX_SPECULATIVE_TOKENS = 3  # the MTP block applied recurrently: the reference supports 1..3
MTP_PREFIX = "mtp.0."


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
    tensor_parallel_size: int | None = None  # built: WORLD_SIZE under torchrun, else 1 unless given
    data_parallel_size: int = 1  # engine replicas behind one daemon (serve), each on its own cores
    data_parallel_size_local: int | None = None  # replicas node 0 runs itself when others join (`replicas_here`)
    data_parallel_address: str | None = None  # node 0's address, where replicas of other hosts join
    data_parallel_rpc_port: int | None = None
    data_parallel_rank: int = 0  # > 0: this process is that replica, joining node 0's daemon
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_timeout: float = 60.0
    plan_transport: str = "auto"  # built: "shm" (one host, T > 1) or "object"; no flag (LLM, benchmarks)
    # --compile: decode dispatches captured per bucket at startup (engine/compile/compiled.py); "auto" (the
    # CLI's default): the buckets cached load, serve builds the others in the background
    compile: bool | str = False
    kv_cache_memory: int | float | str | None = None  # --kv-cache-memory; built: bytes of the block pool
    enable_prefix_caching: bool = True
    draft_vocab: str | None = None  # --draft-vocab: auto, off or a file; built: the file's absolute path or "off"
    grammar_compile_timeout: float = 10.0  # --grammar-compile-timeout: seconds one grammar may compile
    revision: str | None = None  # --revision of a hub model; built: its commit (None for a directory)
    # `dsv4 plan`: a config.json alone will do (weights as the official layout stores them), and
    # `memory` (bytes) is the machine's memory the defaults are sized for; nothing loads
    planning: bool = field(default=False, compare=False)
    memory: int | None = field(default=None, compare=False)
    # Resolved from the checkpoint while validating (not arguments).
    model_id: str | None = field(init=False, default=None)  # the hub model ORG/NAME `model` is a snapshot of
    model_config: ModelConfig = field(init=False, repr=False, compare=False)
    has_mtp: bool = field(init=False)
    sampling_defaults: dict = field(init=False, repr=False, compare=False)  # from generation_config.json
    launch: Launch | None = field(init=False, repr=False, compare=False)  # torchrun's variables, if set
    block_size: int = field(init=False, compare=False)  # positions per block of compressed state
    kv_cache_blocks: int = field(init=False, compare=False)  # blocks in the pool
    draft_vocab_ids: list[int] | None = field(init=False, repr=False, compare=False)  # the MTP's tokens (None: all)
    replicas_here: int = field(init=False, compare=False)  # engine replicas this process runs (or, joining, is)

    @classmethod
    def create(cls, model: str, **kw: Any) -> "EngineConfig":
        """Resolve defaults and validate; raises `EngineConfigError`."""
        return cls(model=model, **kw)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        path, snap = check_model_dir(self.model, self.revision)
        set_("model", path)
        set_("model_id", snap.repo_id if snap is not None else None)
        set_("revision", snap.commit if snap is not None else None)
        set_("device", check_device(self.device))
        set_("dtype", resolve_dtype(self.dtype, self.device))
        check_int("--max-num-seqs", self.max_num_seqs, minimum=1)
        check_int("--long-prefill-token-threshold", self.long_prefill_token_threshold, minimum=0,
                   hint="0 = no extra limit")
        check_int("--seed", self.seed, minimum=0)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise EngineConfigError(f"--enable-chunked-prefill must be true or false, "
                                    f"got {self.enable_chunked_prefill!r}")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise EngineConfigError(f"--compile must be true, false or auto, got {self.compile!r}")
        if self.profile_dir is not None:
            set_("profile_dir", check_profile_dir(self.profile_dir))
        set_("replicas_here", check_data_parallel_hosts(
            self.data_parallel_size, self.data_parallel_size_local, self.data_parallel_address,
            self.data_parallel_rpc_port, self.data_parallel_rank))
        check_data_parallel(self.replicas_here, self.threads, self.planning,
                            "--data-parallel-size" if self.data_parallel_address is None else "--data-parallel-size-local")
        if self.threads is not None:
            check_int("--threads", self.threads, minimum=1)
        t = self.grammar_compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise EngineConfigError(f"--grammar-compile-timeout must be a number of seconds in (0, 3600], got {t!r}")
        set_("sampling_defaults", generation_defaults(Path(self.model)))

        try:
            mc = ModelConfig.from_dir(self.model)
        except ConfigError as e:
            raise EngineConfigError(f"--model {self.model}: {e}") from None
        set_("model_config", mc)
        set_("launch", torchrun_launch())
        set_("tensor_parallel_size", resolve_tensor_parallel(
            self.tensor_parallel_size, self.launch, nnodes=self.nnodes, node_rank=self.node_rank,
            master_addr=self.master_addr, master_port=self.master_port))
        check_tensor_parallel(self.tensor_parallel_size, mc, self.device,
                               self.hosts,
                               "--tensor-parallel-size" if self.launch is None else "WORLD_SIZE")
        check_hosts(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr, self.master_port,
                    self.rendezvous_timeout)
        check_replicas(self.data_parallel_size, self.device, self.hosts, self.launch is not None, self.master_port)
        if self.threads is None:  # one fewer than the cores; a replica's rank: its share of them
            n = self.replicas_here
            set_("threads", default_threads(None if n == 1 else n * self.tensor_parallel_size))
        set_("plan_transport", resolve_transport(self.plan_transport, hosts=self.hosts,
                                                 tensor_parallel_size=self.tensor_parallel_size))
        official = self.planning and not any(Path(self.model).glob("*.safetensors"))
        set_("quantization", resolve_quantization(self.quantization, self.model, self.device, check_files=not official))
        names = {MTP_PREFIX + "x"} if official else weight_names(Path(self.model))
        set_("has_mtp", mc.num_nextn_predict_layers > 0 and any(n.startswith(MTP_PREFIX) for n in names))

        # Speculative decoding.
        k = self.num_speculative_tokens
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        auto = k is None or k == "auto"  # under tensor parallelism too: each plan carries the step's K
        if auto:
            k = self.mtp_depth  # 0 without MTP weights
        set_("speculative_auto", bool(auto or self.speculative_auto) and self.has_mtp and k > 0)
        check_int("--num-speculative-tokens", k, minimum=0, hint="or auto")
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
        self._read_draft_vocab()

        # Prefill limit and step budget.
        given = self.max_num_batched_tokens  # as given (None: the default below)
        plimit = resolve_prefill_limit(self.prefill_limit, self.max_num_batched_tokens, self.kernel_tile,
                                       self.device)
        set_("prefill_limit", plimit)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = plimit + self.max_num_seqs * (1 + k)
        check_int("--max-num-batched-tokens", budget, minimum=1)
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
            mml = max_pos
            if self.single_dispatch:
                mml = min(mml, self.single_dispatch_limit)
        check_int("--max-model-len", mml, minimum=2, hint="one prompt token plus one generated token")
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
            if lim < plimit or self.kernel_tile is None:
                raise EngineConfigError(
                    f"chunked prefill is disabled, but max_model_len {mml} exceeds the single-dispatch prefill "
                    f"limit {lim} (--max-num-batched-tokens); enable chunked prefill, raise "
                    f"--max-num-batched-tokens or lower --max-model-len to {lim}")
            raise EngineConfigError(
                f"chunked prefill is disabled, but max_model_len {mml} exceeds the single-dispatch prefill limit "
                f"{lim} of deepseek_v4 on {self.device}; enable chunked prefill or lower --max-model-len to {lim}")
        most = self.max_num_seqs * (mml + 1 + k)  # every slot's longest row at once: more is never used
        if given is not None and given > most:
            raise EngineConfigError(f"--max-num-batched-tokens {given} is more than a step can use (--max-num-seqs "
                                    f"{self.max_num_seqs} x (--max-model-len {mml} + 1 + K = {1 + k}) = {most}); "
                                    f"lower --max-num-batched-tokens to {most} or less")
        if given is None:  # the default, now that max_model_len is known: no chunk is longer than it
            set_("max_num_batched_tokens", max(1 + k, min(plimit, mml) + self.max_num_seqs * (1 + k)))
        set_("max_model_len", mml)
        self._size_pool()

    def _read_draft_vocab(self) -> None:
        """--draft-vocab -> `draft_vocab` (a path or "off") and its checked ids (module docstring)."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        try:
            path = draft_vocab.resolve(self.draft_vocab, self.model)
            ids = (draft_vocab.read(path, self.model_config.vocab_size)
                   if path is not None and self.num_speculative_tokens > 0 else None)
        except draft_vocab.DraftVocabError as e:
            hint = "" if str(e).startswith("--draft-vocab") else "; give another --draft-vocab, or --draft-vocab off"
            raise EngineConfigError(f"{e}{hint}") from None
        set_("draft_vocab", str(path) if path is not None else "off")
        set_("draft_vocab_ids", ids)

    def _size_pool(self) -> None:
        """Resolve the block pool (module docstring); refuse one that cannot hold a request at
        max_model_len."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not isinstance(self.enable_prefix_caching, bool):
            raise EngineConfigError(f"--enable-prefix-caching must be true or false, got {self.enable_prefix_caching!r}")
        mc, mml = self.model_config, self.max_model_len
        block = state_block_size(mc)
        per_block = block_entry_bytes(mc, block, self.torch_dtype.itemsize)
        one = -(-(mml + self.num_speculative_tokens + 1) // block)  # the runner's positions of one request
        if self.kv_cache_memory is not None:
            budget = parse_memory(self.kv_cache_memory, self.device)
            blocks = budget // per_block
            if blocks < one:
                raise EngineConfigError(
                    f"--kv-cache-memory {self.kv_cache_memory} ({budget} bytes) holds {blocks} blocks of {block} "
                    f"positions, but one request at --max-model-len {mml} needs {one} ({one * per_block} bytes); "
                    f"raise --kv-cache-memory to {one * per_block} or lower --max-model-len")
        else:
            cap = (self.memory or machine_memory(self.device)) // 4
            if one * per_block > cap:
                raise EngineConfigError(
                    f"one request at --max-model-len {mml} needs {one * per_block} bytes of state, more than a "
                    f"quarter of this machine's memory ({cap} bytes); lower --max-model-len or set "
                    f"--kv-cache-memory")
            blocks = max(one, min(self.max_num_seqs * one, cap // per_block))
        set_("block_size", block)
        set_("kv_cache_blocks", blocks)
        set_("kv_cache_memory", blocks * per_block)

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
    def kernel_tile(self) -> int | None:
        """The most prompt tokens the device's prefill kernel takes in one dispatch: the NPU
        kernel's tile (`ModelConfig.prefill_limit`); None on CPU and CUDA, where the chunk is a
        token budget (`--max-num-batched-tokens`)."""
        return self.model_config.prefill_limit if self.device.split(":")[0] == "npu" else None

    @property
    def effective_chunk_size(self) -> int:
        """The most prompt tokens of one request per step (before this step's budget is spent)."""
        limit = min(self.single_dispatch_limit, self.max_model_len)
        if not self.single_dispatch and self.long_prefill_token_threshold > 0:
            limit = min(limit, self.long_prefill_token_threshold)
        return limit

    @property
    def served_model_name(self) -> str:
        """The model's name in the OpenAI API (/v1/models): its hub id, as vLLM names it, else
        the directory's name."""
        return self.model_id or Path(self.model).name

    @property
    def hosts(self) -> int:
        """Hosts the ranks span: --nnodes, or WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun."""
        return self.nnodes if self.launch is None else self.launch.world // self.launch.local_world

    @property
    def ranks_per_host(self) -> int:
        """Ranks on each host (LOCAL_WORLD_SIZE under torchrun)."""
        return self.tensor_parallel_size // self.hosts

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
            + QUANTIZATION_LINES[self.quantization],
            (f"prefill kernel tile {self.kernel_tile}, " if self.kernel_tile is not None else "")
            + f"prefill chunk {self.effective_chunk_size} tokens, step budget {self.max_num_batched_tokens} tokens"
            + (" (single dispatch)" if self.single_dispatch else ""),
            (f"speculative tokens K = auto (0..{self.num_speculative_tokens}, chosen from measured step costs "
             f"and acceptance)" if self.speculative_auto else f"speculative tokens K = {self.num_speculative_tokens}")
            + f" (MTP weights: {'yes' if self.has_mtp else 'no'})"
            + (f"; drafts from {len(self.draft_vocab_ids)} of {self.model_config.vocab_size} tokens "
               f"({self.draft_vocab})" if self.draft_vocab_ids is not None else ""),
            f"CPU threads {self.threads}" + (" (waiting passively)" if passive_waiting() else "")
            + "; default sampling "
            + (", ".join(f"{k} {v}" for k, v in self.sampling_defaults.items()) + " (generation_config.json)"
               if self.sampling_defaults else "greedy (no generation_config.json)"),
            f"state pool {self.kv_cache_blocks} blocks of {self.block_size} positions "
            f"({self.kv_cache_blocks * self.block_size} tokens, {self.kv_cache_memory / 2**20:.1f} MiB); "
            f"longest request {self.max_model_len} tokens; prefix caching "
            + ("on" if self.enable_prefix_caching else "off"),
            "chunked prefill with speculative decoding: "
            + ("supported" if self.model_config.speculation_spans_chunks
               else "not supported by this model (prompts go in one dispatch when K > 0)"),
        ]


# ---------------------------------------------------------------------- defaults
def resolve_prefill_limit(limit: Any, budget: Any, tile: int | None, device: str) -> int:
    """The most prompt tokens of one request per dispatch. Where a kernel has a tile (the NPU's
    128) it is the tile, and may only be lowered; elsewhere the step budget when given, else
    DEFAULT_CHUNK."""
    if limit is None:
        limit = tile if tile is not None else (budget if isinstance(budget, int) and budget > 0 else DEFAULT_CHUNK)
    check_int("prefill_limit", limit, minimum=1)
    if tile is not None and limit > tile:
        raise EngineConfigError(f"prefill_limit {limit} exceeds the prefill limit {tile} of deepseek_v4 on "
                                f"{device} (the kernel's tile); it may only be lowered (or use "
                                f"--long-prefill-token-threshold)")
    return limit


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
MAX_DEFAULT_THREADS = 16


def default_threads(share: int | None = None) -> int:
    """$OMP_NUM_THREADS when set, else one fewer than the CPUs this process may run on (its
    affinity mask, so a container's or taskset's limit counts), at least 1 and at most
    MAX_DEFAULT_THREADS. With `share`: each of that many processes' part of the CPUs (the
    ranks of engine replicas, --data-parallel-size x --tensor-parallel-size, each replica
    pinned to its share: `replicas.cores.cores_of`).

    Why one fewer: an OpenMP team meets at the end of each of the hundreds of parallel regions
    of a step, and its threads wait there by spinning (libgomp, torch's runtime on x86 Linux:
    300,000 turns before they sleep; Intel's: 200 ms). A spinning thread that shares its core
    with other work (another tenant, the daemon's own I/O and HTTP threads) gets that core only
    for its fair slices, so every region waits for a slice and decoding collapses
    (benchmarks/busy_threads.py, BENCHMARKS.md). A team one core short of the machine leaves
    that core to the rest, at a small cost on an idle machine. OMP_WAIT_POLICY=PASSIVE
    (threads sleep at once) also ends the collapse; it costs little where steps are long and
    much where they are hundreds of tiny regions, so the CLI sets it for long-step models
    (`cli.options.choose_wait_policy`), and with it every CPU is the default (figures:
    docs/serving.md, 'dsv4/engine/config.py'). One decode step of a small batch gains little
    from more than MAX_DEFAULT_THREADS."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = usable_cpus()
    own = cpus if passive_waiting() else cpus - 1
    return max(1, min(own if share is None else cpus // share, MAX_DEFAULT_THREADS))


def load_threads(threads: int, ranks_here: int) -> int:
    """Threads for loading the weights (conversion, quantisation, fusing, prepacking: elementwise
    passes that scale with cores): every CPU of this process's affinity for one rank on the host,
    unless $OMP_NUM_THREADS holds the process to fewer; never fewer than `threads`. The serving
    steps then run on `threads` (`default_threads`: one core is left to the rest while serving,
    which matters only once steps spin)."""
    if ranks_here > 1 or os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return threads
    return max(threads, usable_cpus())


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
