"""Pieces shared by the CLI commands: exit statuses, the CLI error type, engine options.

Engine flags map one to one onto `dsv4.engine.config.EngineConfig` fields; a flag left
out is not passed, so the config's own defaults (resolved from the checkpoint) apply.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

import dsv4

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: no daemon
EXIT_TIMEOUT = 75  # EX_TEMPFAIL
EXIT_INTERRUPTED = 130

ENGINE_PANEL = "Engine options"
MAX_INT = 2**31 - 1  # counts (tokens, requests) at the CLI: larger ones are usage errors, not overflows
MAX_SEED = 2**64 - 1


class CliError(Exception):
    """A failure to report as one stderr line with an exit status."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def err(msg: str) -> None:
    """One line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def int_range(minimum: int | None = None, maximum: int = MAX_INT) -> Callable[[Optional[int]], Optional[int]]:
    """Option callback: an integer in minimum..maximum, else a usage error naming the option.
    Used instead of typer's min/max, whose help prints `[x<=2147483647]` on every count."""

    def check(value: Optional[int]) -> Optional[int]:
        if value is not None and minimum is not None and value < minimum:
            raise typer.BadParameter(f"must be at least {minimum}, got {value}")
        if value is not None and value > maximum:
            raise typer.BadParameter(f"must be at most {maximum}, got {value}")
        return value

    return check


def install_hint(extra: str) -> str:
    """The command that installs the `extra` into the Python running dsv4: the checkout's
    scripts/venv.sh when this is its virtual environment, else this interpreter's pip
    (a bare `pip` on PATH may belong to another Python)."""
    import os

    root = Path(dsv4.__file__).resolve().parents[1]
    python = sys.executable or "python3"
    if not (root / "pyproject.toml").is_file():
        return f"{python} -m pip install 'dsv4[{extra}]'"
    venv = Path(os.environ.get("DSV4_VENV") or ".venv")
    venv = venv if venv.is_absolute() else root / venv
    if (root / "scripts" / "venv.sh").is_file() and Path(sys.prefix).resolve() == venv.resolve():
        return f"{root / 'scripts' / 'venv.sh'} {extra}"
    return f"{python} -m pip install -e '{root}[{extra}]'"


def check_extra(extra: str, modules: tuple[str, ...], flag: str) -> None:
    """A usage error naming the missing module and how to install `extra` when one of
    `modules` cannot be imported (checked without importing them)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"{flag} needs the {extra} extra ({missing[0]} is missing): {install_hint(extra)}", EXIT_USAGE)


# ---------------------------------------------------------------------- option types
Socket = Annotated[Optional[str], typer.Option(
    "--socket", metavar="ENDPOINT",
    help="Daemon endpoint: ipc:///path/to/socket, a socket path, or tcp://HOST:PORT "
         "[default: $DSV4_SOCKET, else ipc://$XDG_RUNTIME_DIR/dsv4/dsv4.sock]")]
Http = Annotated[Optional[str], typer.Option(
    "--http", metavar="HOST:PORT",
    help="Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
         "/health, /metrics) and a chat page (/) on HOST:PORT; a host other than loopback needs --api-key "
         "[default: off]")]
MaxPrompts = Annotated[Optional[int], typer.Option(
    "--max-prompts-per-request", metavar="N", callback=int_range(1, 1024),
    help="With --http: most prompts one /v1/completions request may list (more: 400), so one request "
         "cannot fill the daemon or sidestep n = 1 [default: 64]")]
AllowedHosts = Annotated[Optional[str], typer.Option(
    "--allowed-hosts", metavar="HOSTS",
    help="With --http: more names the Host header may carry, comma-separated ('*': any); requests naming "
         "another host get 400 (stops DNS rebinding) [default: loopback names and addresses for a loopback "
         "--http; any host otherwise]")]
AllowedOrigins = Annotated[Optional[str], typer.Option(
    "--allowed-origins", metavar="ORIGINS",
    help="With --http: web origins (e.g. http://localhost:3000) whose cross-origin requests are served, "
         "with CORS headers, comma-separated ('*': any); other origins get 403 [default: none]")]
ApiKey = Annotated[Optional[str], typer.Option(
    "--api-key", metavar="KEY", envvar="DSV4_API_KEY", show_envvar=False,
    help="Shared secret every request must carry (ZeroMQ requests; 'Authorization: Bearer KEY' over HTTP); "
         "required to serve on a non-loopback address. Prefer the environment variable: a flag is visible "
         "to other users in ps [env: DSV4_API_KEY]")]
Tools = Annotated[Optional[str], typer.Option(
    "--tools", metavar="FILE", help="OpenAI function tools (a JSON list) the model may call: rendered into "
    "the prompt; its calls print as lines after the answer (--json: tool_calls).")]
ToolChoice = Annotated[str, typer.Option(
    "--tool-choice", metavar="CHOICE", help="With --tools: auto (the model decides), none (tools not rendered), "
    "required or a function's name (a call forced by a grammar).")]
Model = Annotated[Optional[str], typer.Option(
    "--model", metavar="DIR|ORG/NAME", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a Hugging Face hub model "
         "ORG/NAME: its snapshot in the hub cache, pulled first when missing (as 'dsv4 pull'; not with "
         "HF_HUB_OFFLINE=1); a directory of that name wins [default: the embedded tiny-shakespeare model]")]
Revision = Annotated[Optional[str], typer.Option(
    "--revision", metavar="REV", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="With --model ORG/NAME: the branch, tag or commit of the hub model [default: main]")]
Device = Annotated[Optional[str], typer.Option(
    "--device", metavar="DEVICE", rich_help_panel=ENGINE_PANEL, help="cpu, cuda, cuda:N or npu [default: cpu]")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="DTYPE", rich_help_panel=ENGINE_PANEL,
    help="auto, float32, bfloat16 or float16 [default: auto = float32 on cpu, bfloat16 otherwise]")]
MaxNumSeqs = Annotated[Optional[int], typer.Option(
    "--max-num-seqs", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(),
    help="Most requests running at once (state slots) [default: 8]")]
MaxModelLen = Annotated[Optional[int], typer.Option(
    "--max-model-len", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(),
    help="Most tokens (prompt + output) of one request [default: the model's maximum]")]
MaxBatched = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(),
    help="Token budget of one engine step, decodes and prefill chunks together; on CPU and CUDA it sets "
         "the prefill chunk (on NPU the kernel's 128-token tile caps it) "
         "[default: 512 + max-num-seqs * (1 + K)]")]
LongPrefill = Annotated[Optional[int], typer.Option(
    "--long-prefill-token-threshold", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(),
    help="Lower the prefill chunk size below what the step budget allows (0 = no extra limit) [default: 0]")]
Chunked = Annotated[Optional[bool], typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="Split long prompts into chunks that fit the step budget; off = each prompt in one dispatch "
         "[default: on]")]
NumSpec = Annotated[Optional[str], typer.Option(
    "--num-speculative-tokens", metavar="K", rich_help_panel=ENGINE_PANEL,
    help="MTP drafts per decode step, 0 = off; auto = 0..3 chosen each step from measured step costs and "
         "the acceptance rate [default: auto when the checkpoint has MTP weights, else 0]")]
EngineSeed = Annotated[Optional[int], typer.Option(
    "--seed", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(0, MAX_SEED),
    help="Engine random seed, 0..2^64-1 [default: 0]")]
Profile = Annotated[Optional[Path], typer.Option(
    "--profile", metavar="DIR", rich_help_panel=ENGINE_PANEL, envvar="DSV4_PROFILE_DIR", show_envvar=False,
    help="Write torch profiler traces of engine steps (prefill chunks, verify, MTP) into DIR; off by default "
         "[env: DSV4_PROFILE_DIR]")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", metavar="N", rich_help_panel=ENGINE_PANEL, callback=int_range(1),
    help="CPU threads of the engine (torch.set_num_threads); lower it when several engines share a machine "
         "[default: $OMP_NUM_THREADS, else every CPU this process may use where OpenMP waits passively "
         "(OMP_WAIT_POLICY=PASSIVE, set for models of hidden size >= 2048), else one fewer, 1 to 16]")]
Quantization = Annotated[Optional[str], typer.Option(
    "--quantization", metavar="FORMAT", rich_help_panel=ENGINE_PANEL,
    help="Weight format: none; w8a8 (int8 weights with per-row scales, int8 activations per token); mxfp4 "
         "(the routed experts kept as the checkpoint's FP4, the rest unquantised); w8a8-mxfp4 (FP4 routed "
         "experts, the rest w8a8, int8 activations) [default: as the checkpoint is stored where it fits the "
         "memory, else the first of w8a8-mxfp4, mxfp4, w8a8 that fits]")]
DraftVocab = Annotated[Optional[str], typer.Option(
    "--draft-vocab", metavar="FILE", rich_help_panel=ENGINE_PANEL,
    help="MTP drafts propose only the tokens of FILE (written by 'dsv4 draft-vocab'): a smaller draft head "
         "to read, the same output; auto = the checkpoint's draft_vocab.json if it has one, off = every "
         "token [default: auto]")]
Compile = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="Compile the decode steps per bucket of token counts at startup (minutes on a small CPU when "
         "not cached under $XDG_CACHE_HOME/dsv4/inductor); falls back to eager where it cannot. Neither "
         "flag: the cached buckets load, and serve builds the others in the background [default: "
         "$DSV4_COMPILE (auto, on, off), else auto]")]
KvCacheMemory = Annotated[Optional[str], typer.Option(
    "--kv-cache-memory", metavar="SIZE", rich_help_panel=ENGINE_PANEL,
    help="Memory for the requests' compressed state, a pool of blocks shared by every request and the "
         "prefix cache: bytes (e.g. 2GiB, 512M) or a fraction of the memory free now (e.g. 0.2) [default: "
         "max-num-seqs requests at max-model-len, within a quarter of the machine's memory, at least one]")]
PrefixCaching = Annotated[Optional[bool], typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="Reuse the state of a prompt's cached prefix (whole blocks of 256 tokens) instead of prefilling it "
         "again [default: on]")]
TensorParallel = Annotated[Optional[int], typer.Option(
    "--tensor-parallel-size", metavar="T", rich_help_panel=ENGINE_PANEL,
    help="Spread the model over T ranks (heads, experts and vocabulary split T ways; with --device cuda "
         "rank r uses cuda:r, on cpu T processes) [default: 1; WORLD_SIZE under torchrun]")]
DataParallel = Annotated[Optional[int], typer.Option(
    "--data-parallel-size", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Run N engine replicas behind the daemon, each a process pinned to its share of the cores "
         "(--threads is per replica); requests go to the replica holding the longest prefix of their prompt, "
         "else the least loaded [default: 1]")]
DataParallelLocal = Annotated[Optional[int], typer.Option(
    "--data-parallel-size-local", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Replicas node 0 runs itself when others join from other hosts "
         "[default: --data-parallel-size; 1 with --data-parallel-address]")]
DataParallelAddress = Annotated[Optional[str], typer.Option(
    "--data-parallel-address", metavar="ADDR", rich_help_panel=ENGINE_PANEL,
    help="Node 0's address, where replicas of other hosts join (the same on every host; each host needs "
         "the same DSV4_API_KEY)")]
DataParallelRpcPort = Annotated[Optional[int], typer.Option(
    "--data-parallel-rpc-port", metavar="PORT", rich_help_panel=ENGINE_PANEL,
    help="Free TCP port on node 0 where replicas of other hosts join")]
DataParallelRank = Annotated[Optional[int], typer.Option(
    "--data-parallel-rank", metavar="R", rich_help_panel=ENGINE_PANEL,
    help="On another host: be replica R (1..N-1) of node 0's daemon; binds nothing [default: 0]")]
NNodes = Annotated[Optional[int], typer.Option(
    "--nnodes", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Hosts the T ranks span (the same serve command on each, T / N ranks per host) [default: 1]")]
NodeRank = Annotated[Optional[int], typer.Option(
    "--node-rank", metavar="R", rich_help_panel=ENGINE_PANEL,
    help="This host's place 0..N-1; node 0 serves clients, the others bind nothing [default: 0]")]
MasterAddr = Annotated[Optional[str], typer.Option(
    "--master-addr", metavar="ADDR", rich_help_panel=ENGINE_PANEL,
    help="Address of node 0, where the ranks meet (needed with --nnodes > 1)")]
MasterPort = Annotated[Optional[int], typer.Option(
    "--master-port", metavar="PORT", rich_help_panel=ENGINE_PANEL,
    help="Free TCP port on node 0 for the rendezvous (needed with --nnodes > 1)")]
RendezvousTimeout = Annotated[Optional[float], typer.Option(
    "--rendezvous-timeout", metavar="SECONDS", rich_help_panel=ENGINE_PANEL,
    help="How long the ranks wait for each other at startup [default: 60]")]
GrammarTimeout = Annotated[Optional[float], typer.Option(
    "--grammar-compile-timeout", metavar="SECONDS", rich_help_panel=ENGINE_PANEL,
    help="Longest a structured-output grammar may compile (in a worker process; longer: the request "
         "is refused with 400) [default: 10]")]

# flag -> EngineConfig field
ENGINE_FLAGS = {
    "model": "--model", "device": "--device", "dtype": "--dtype", "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len", "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "enable_chunked_prefill": "--enable-chunked-prefill", "num_speculative_tokens": "--num-speculative-tokens",
    "seed": "--seed", "profile_dir": "--profile", "threads": "--threads", "quantization": "--quantization",
    "tensor_parallel_size": "--tensor-parallel-size", "data_parallel_size": "--data-parallel-size",
    "data_parallel_size_local": "--data-parallel-size-local", "data_parallel_address": "--data-parallel-address",
    "data_parallel_rpc_port": "--data-parallel-rpc-port", "data_parallel_rank": "--data-parallel-rank",
    "nnodes": "--nnodes", "node_rank": "--node-rank",
    "master_addr": "--master-addr", "master_port": "--master-port", "rendezvous_timeout": "--rendezvous-timeout",
    "compile": "--compile", "kv_cache_memory": "--kv-cache-memory", "enable_prefix_caching": "--enable-prefix-caching",
    "draft_vocab": "--draft-vocab", "revision": "--revision", "grammar_compile_timeout": "--grammar-compile-timeout",
}


COMPILE_ENV = {"auto": "auto", "on": True, "1": True, "true": True, "off": False, "0": False, "false": False}


def compile_default() -> bool | str:
    """--compile when neither --compile nor --no-compile is given: $DSV4_COMPILE (auto, on or
    off), else auto (cached compiled buckets load; `serve` builds the others in the background)."""
    text = os.environ.get("DSV4_COMPILE", "").strip().lower()
    if text not in COMPILE_ENV and text:
        raise CliError(f"DSV4_COMPILE must be auto, on or off, got {text!r}", EXIT_USAGE)
    return COMPILE_ENV.get(text, "auto")


def engine_kwargs(**given: Any) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags given (None = not given); --model defaults to the asset,
    --compile to `compile_default()`. Paths are made absolute (a detached daemon runs in `/`); a --model that
    is not a directory is left as it is (a hub model ORG/NAME: `dsv4.cli.hub.fetch_model` pulls it)."""
    kw = {k: (str(v.absolute()) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
    if "model" in kw and Path(kw["model"]).expanduser().exists():  # a directory; else maybe a hub model ORG/NAME
        kw["model"] = str(Path(kw["model"]).expanduser().absolute())
    if "draft_vocab" in kw:  # a file, made absolute (a string: auto and off are words)
        word = kw["draft_vocab"].strip()
        kw["draft_vocab"] = word if word in ("auto", "off") else str(Path(word).expanduser().absolute())
    kw.setdefault("model", str(dsv4.DEFAULT_MODEL))
    if "compile" in given:
        kw.setdefault("compile", compile_default())
    return kw


def local_engine_kwargs(local: bool, **given: Any) -> dict[str, Any]:
    """`engine_kwargs` for a command's --local engine; engine flags given without --local
    are a usage error naming them (the daemon has its own settings)."""
    if not local:
        flags = [ENGINE_FLAGS[k] for k, v in given.items() if v is not None]
        if flags:
            raise CliError(f"{', '.join(flags)} {'apply' if len(flags) > 1 else 'applies'} only with --local "
                           f"(the daemon has its own settings)", EXIT_USAGE)
    return engine_kwargs(**given)


def engine_argv(kw: dict[str, Any]) -> list[str]:
    """Command-line flags reproducing `engine_kwargs` output (for `serve --detach`)."""
    argv: list[str] = []
    for key, value in kw.items():
        flag = ENGINE_FLAGS[key]
        if key in ("enable_chunked_prefill", "enable_prefix_caching"):
            argv.append(flag if value else flag.replace("--enable-", "--no-enable-"))
        elif key == "compile":
            if value != "auto":  # auto: the default, also where the argv is read again
                argv.append(flag if value else "--no-compile")
        else:
            argv += [flag, str(value)]
    return argv


def finite(value: float | None) -> float | None:
    """Option callback: refuse inf and nan (a usage error naming the option)."""
    import math

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value


def check_listen_key(endpoint: str, api_key: str | None) -> bool:
    """Refuse a non-loopback tcp:// endpoint without an API key (usage error naming the flag);
    True when the daemon will listen on loopback tcp without a key (worth a warning)."""
    if not endpoint.startswith("tcp://") or api_key:
        return False
    import ipaddress

    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise CliError(f"serving on {endpoint} lets anyone who can reach it read and stop the daemon: set a "
                       f"shared secret with --api-key or DSV4_API_KEY (clients need the same key)", EXIT_USAGE)
    return True


# hidden width from which a decode step's parallel regions are long enough that OpenMP threads
# sleeping at each barrier cost little (the peer's V4 Flash slice, 4096: 0.89x of spinning
# threads' decode rate on an idle machine; the embedded model, whose regions are tiny: 0.42x)
LONG_STEP_HIDDEN = 2048


def choose_wait_policy(model: str | None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for a model whose steps are long (config.json's hidden_size
    >= LONG_STEP_HIDDEN), unless the environment sets a policy or torch (and with it OpenMP,
    which reads the policy once, when it loads) is imported already. Then the engine's default
    threads take every core (`engine.config.default_threads`): sleeping threads leave a core
    to whatever else runs, where spinning ones collapse beside it. Returns whether it set it."""
    from dsv4.config import ConfigError, ModelConfig  # no torch

    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules or not model:
        return False
    try:
        if ModelConfig.from_dir(Path(model).expanduser()).hidden_size < LONG_STEP_HIDDEN:
            return False
    except ConfigError:  # the engine's validation reports it
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def build_config(kw: dict[str, Any], check_memory: bool = True) -> Any:
    """A validated EngineConfig, or `CliError` (usage) with the validation message; loads no
    weights; first, before torch loads, OpenMP's wait policy for the model
    (`choose_wait_policy`). `check_memory`: without --quantization, take the formats that fit this machine
    (`memory_plan.fit_default`: float32 where it fits, else the checkpoint's own), and refuse a
    configuration whose memory plan does not fit (`memory_plan.check`), naming the figures and
    the flags that would."""
    if not kw.get("planning"):
        choose_wait_policy(kw.get("model"))  # before torch loads (EngineConfig imports it)
    from dsv4.engine.config import EngineConfig, EngineConfigError

    try:
        config = EngineConfig.create(**kw)
        if check_memory and config.node_rank == 0:
            from dsv4.engine.memory_plan import settle

            config, note = settle(config, kw.get("quantization") is not None)
            if note:
                print(f"dsv4: {note}", file=sys.stderr)
        return config
    except EngineConfigError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def under_torchrun() -> bool:
    """torchrun's variables are set: `run` and `bench` imply --local (torchrun's own parser
    reads `--local` as an ambiguous abbreviation of its --local-addr/--local-ranks-filter)."""
    import os

    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def torchrun_follower(kw: dict[str, Any]) -> None:
    """Under torchrun, RANK > 0 of `serve`, `run --local` and `bench --local`: validate the
    same engine options, join rank 0's group, run its steps until it stops, then exit
    (status 0; 1 with one line when the group fails). Returns at once on rank 0 and
    outside torchrun (before anything reads stdin or binds a socket)."""
    from dsv4.engine.config import EngineConfigError
    from dsv4.engine.parallel.launch import torchrun_launch

    try:
        launch = torchrun_launch()
    except EngineConfigError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if launch is None or launch.rank == 0:
        return
    config = build_config(kw, check_memory=False)  # rank 0 checked the host's plan
    from dsv4.engine.parallel.ranks import RankError, serve_node

    try:
        code = serve_node(config)
    except RankError as e:
        raise CliError(str(e)) from None
    from dsv4.daemon.process import exit_now

    exit_now(code)  # the group is left


def read_tool_options(tools: str | None, choice: str) -> tuple[list[dict[str, Any]] | None, str]:
    """--tools FILE and --tool-choice -> (the tools, checked, or None; the choice): a usage
    error naming the flag otherwise."""
    from dsv4.cli.tools import check_choice, read_tools

    try:
        tool_list = read_tools(tools) if tools is not None else None
        return tool_list, check_choice(choice, tool_list)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
