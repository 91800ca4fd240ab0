"""The `dsv4` command: serve, run, chat, status, stop, bench, convert, draft-vocab, pull, models.

`main()` is the console entry point. It maps every failure to one stderr line and an
exit status (0 ok, 1 error, 2 usage, 69 daemon unreachable, 75 timeout, 130
interrupted); a traceback is printed only when DSV4_DEBUG=1. stdout carries only what a
command produces (generated text, status, JSON); logs and progress go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from dsv4 import __version__
from dsv4.cli import options as O
from dsv4.cli.bench import bench
from dsv4.cli.chat import chat
from dsv4.cli.draft_vocab import draft_vocab
from dsv4.cli.hub import fetch_model, model_dir, models, pull
from dsv4.cli.plan import plan
from dsv4.cli.run import run
from dsv4.cli.options import CliError
from dsv4.daemon.paths import resolve_endpoint

app = typer.Typer(
    name="dsv4", add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
    help="Serve DeepSeek V4 from one machine: a long-lived daemon holds the model, the CLI talks to it.",
)
# Each command's line in `dsv4 --help` is its `short_help`: a whole sentence, where click
# would cut the help text at its first period ("e.g.") or at 45 characters.
app.command("run", short_help="Generate text for a prompt and stream it to stdout.",
            help="Generate text for a prompt (argument, '-' or piped stdin); stream it to stdout.")(run)
app.command("chat", short_help="Chat with the daemon's model interactively.",
            help="Chat with the daemon's model interactively: history, /set, /clear, /bye; "
                 "Ctrl-C cancels the current answer.")(chat)
app.command("bench", short_help="Benchmark the daemon: latency, throughput and MTP acceptance.",
            help="Benchmark the daemon (or --local): TTFT, TPOT, throughput, MTP acceptance, "
                 "MTP on versus off.")(bench)


def _version(value: bool) -> None:
    if value:
        print(f"dsv4 {__version__}")
        raise typer.Exit(O.EXIT_OK)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Serve DeepSeek V4 from one machine."""


@app.command(short_help="Load the model and serve it (in the background with --detach).")
def serve(
    model: O.Model = None, device: O.Device = None, dtype: O.Dtype = None, max_num_seqs: O.MaxNumSeqs = None,
    max_model_len: O.MaxModelLen = None, max_num_batched_tokens: O.MaxBatched = None,
    long_prefill_token_threshold: O.LongPrefill = None, enable_chunked_prefill: O.Chunked = None,
    num_speculative_tokens: O.NumSpec = None, seed: O.EngineSeed = None, profile: O.Profile = None,
    threads: O.Threads = None, quantization: O.Quantization = None, tensor_parallel_size: O.TensorParallel = None,
    data_parallel_size: O.DataParallel = None, data_parallel_size_local: O.DataParallelLocal = None,
    data_parallel_address: O.DataParallelAddress = None, data_parallel_rpc_port: O.DataParallelRpcPort = None,
    data_parallel_rank: O.DataParallelRank = None, compile: O.Compile = None, kv_cache_memory: O.KvCacheMemory = None,
    enable_prefix_caching: O.PrefixCaching = None, draft_vocab: O.DraftVocab = None, revision: O.Revision = None,
    grammar_compile_timeout: O.GrammarTimeout = None, nnodes: O.NNodes = None, node_rank: O.NodeRank = None,
    master_addr: O.MasterAddr = None,
    master_port: O.MasterPort = None, rendezvous_timeout: O.RendezvousTimeout = None, socket: O.Socket = None,
    http: O.Http = None, max_prompts_per_request: O.MaxPrompts = None,
    allowed_hosts: O.AllowedHosts = None, allowed_origins: O.AllowedOrigins = None, api_key: O.ApiKey = None,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background: return once the daemon "
                                         "answers, print its pid and endpoint; log to $XDG_STATE_HOME/dsv4/dsv4.log")
                      ] = False,
) -> None:
    """Load the model and serve it until SIGTERM, SIGINT or 'dsv4 stop'."""
    from dsv4.daemon import paths

    kw = O.engine_kwargs(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                         long_prefill_token_threshold=long_prefill_token_threshold,
                         enable_chunked_prefill=enable_chunked_prefill, num_speculative_tokens=num_speculative_tokens,
                         seed=seed, profile_dir=profile, threads=threads, quantization=quantization, compile=compile,
                         kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                         draft_vocab=draft_vocab, revision=revision, grammar_compile_timeout=grammar_compile_timeout,
                         tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                         data_parallel_size_local=data_parallel_size_local, data_parallel_address=data_parallel_address,
                         data_parallel_rpc_port=data_parallel_rpc_port, data_parallel_rank=data_parallel_rank,
                         nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                         rendezvous_timeout=rendezvous_timeout)
    if data_parallel_address is not None and not api_key:
        raise CliError("--data-parallel-address: replicas of other hosts prove a shared key when they join; set "
                       "DSV4_API_KEY (or --api-key) to the same secret on every host", O.EXIT_USAGE)
    if data_parallel_rank and http is not None:
        raise CliError("--http with --data-parallel-rank: clients talk to node 0's daemon; a joining replica "
                       "serves none itself", O.EXIT_USAGE)
    if detach and data_parallel_rank:
        raise CliError("--detach with --data-parallel-rank: a joining replica has no socket to detach to; run it "
                       "in the foreground (or under a service manager)", O.EXIT_USAGE)
    if detach and O.under_torchrun():
        raise CliError("--detach cannot be used under torchrun (it supervises the ranks); serve in the foreground",
                       O.EXIT_USAGE)
    if O.under_torchrun():
        fetch_model(kw)  # every rank: a hub model missing from this host's cache is pulled (file locks share it)
    O.torchrun_follower(kw)  # under torchrun, RANK > 0 follows rank 0's steps here and exits
    endpoint = resolve_endpoint(socket)
    if O.check_listen_key(endpoint, api_key):
        O.err(f"dsv4: warning: serving on {endpoint} without --api-key: any local user can use the daemon")
    paths.ensure_private_dir(paths.state_dir(endpoint))  # refuses a directory another user controls
    fetch_model(kw)  # --model ORG/NAME: pulled when missing (as vLLM does), then found in the cache
    config = O.build_config(kw)  # validation only: no weights are read
    http_server = None
    if http is not None:
        O.check_extra("http", ("fastapi", "uvicorn", "prometheus_client"), "--http")
        from dsv4.http.server import HttpError, HttpServer, parse_address

        from dsv4.http.guard import split_list

        try:
            http_server = HttpServer(parse_address(http, api_key), api_key, allowed_hosts=split_list(allowed_hosts),
                                     allowed_origins=split_list(allowed_origins))
        except HttpError as e:
            raise CliError(str(e), O.EXIT_USAGE) from None
        http_server.max_prompts = max_prompts_per_request
        if not api_key:
            O.err(f"dsv4: warning: serving HTTP on {http_server.address} without --api-key: any local user "
                  f"or program can use the API")
    elif allowed_hosts is not None or allowed_origins is not None:
        raise CliError("--allowed-hosts and --allowed-origins need --http", O.EXIT_USAGE)
    if max_prompts_per_request is not None and http is None:
        raise CliError("--max-prompts-per-request needs --http", O.EXIT_USAGE)
    if detach:
        from dsv4.daemon.process import AlreadyRunning, engine_settings, report_running, spawn_detached

        if paths.daemon_pid(endpoint) is not None:
            same, line = report_running(endpoint, engine_settings(config, set(kw)), api_key)
            if not same:
                raise CliError(line)
            O.err(line)
            raise typer.Exit(O.EXIT_OK)
        try:
            http_argv = ["--http", http] if http is not None else []
            if max_prompts_per_request is not None:
                http_argv += ["--max-prompts-per-request", str(max_prompts_per_request)]
            http_argv += ["--allowed-hosts", allowed_hosts] if allowed_hosts is not None else []
            http_argv += ["--allowed-origins", allowed_origins] if allowed_origins is not None else []
            pid, logf = spawn_detached([*O.engine_argv(kw), "--socket", endpoint, *http_argv], endpoint,
                                       api_key=api_key)
        except TimeoutError as e:
            raise CliError(str(e), O.EXIT_TIMEOUT) from None
        except AlreadyRunning as e:  # another serve won the race with the same settings
            O.err(str(e))
            raise typer.Exit(O.EXIT_OK) from None
        except RuntimeError as e:
            raise CliError(str(e)) from None
        url = f", OpenAI API at http://{http_server.address}/v1" if http_server is not None else ""
        print(f"dsv4 daemon started: pid {pid}, endpoint {endpoint}{url}, log {logf}")
        raise typer.Exit(O.EXIT_OK)
    from dsv4.daemon.process import run_daemon

    raise typer.Exit(run_daemon(config, endpoint, http_server, api_key=api_key, given=set(kw)))


@app.command(short_help="Show the daemon's model, uptime, requests and throughput.")
def status(
    socket: O.Socket = None, api_key: O.ApiKey = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON object (with --watch: "
                                                           "one per line).")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="A live view, redrawn every --interval: output tok/s, "
                                                          "acceptance and prefix cache hits over the last interval, "
                                                          "requests, state pool use, compile progress.")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS", min=0.1,
                                            help="Seconds between polls of --watch.")] = 1.0,
    count: Annotated[Optional[int], typer.Option("--count", metavar="N", min=1,
                                                 help="With --watch: stop after N polls (default: until Ctrl-C).")
                     ] = None,
) -> None:
    """Show the daemon's model, device, uptime, requests, totals and MTP acceptance."""
    from dsv4.daemon.client import Client

    with Client(resolve_endpoint(socket), api_key=api_key) as c:
        c.connect()
        if watch:
            from dsv4.cli.status_watch import watch as live

            raise typer.Exit(live(c.status, interval, count, as_json))
        st = c.status()
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return
    from dsv4.cli.status_view import status_lines

    print("\n".join(status_lines(st)))


@app.command(short_help="Stop the daemon and wait until it has exited.")
def stop(
    socket: O.Socket = None, api_key: O.ApiKey = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", min=0,
                                           help="How long to wait for the daemon to exit (exit 75 after).")] = 30.0,
) -> None:
    """Stop the daemon: in-flight requests are cancelled, their clients told; returns once it has exited."""
    from dsv4.daemon.client import Client, wait_for_release

    endpoint = resolve_endpoint(socket)
    with Client(endpoint, api_key=api_key) as c:
        pong = c.connect()
        c.shutdown()
    pid = pong.get("pid") if isinstance(pong.get("pid"), int) else None
    if not wait_for_release(endpoint, timeout, pid):
        raise CliError(f"the dsv4 daemon (pid {pong.get('pid')}) is still exiting after {timeout:g} s",
                       O.EXIT_TIMEOUT)
    O.err(f"dsv4 daemon (pid {pong.get('pid')}) stopped")


@app.command(short_help="Convert a checkpoint to w8a8 once, ahead of serving it.")
def convert(
    src: Annotated[str, typer.Argument(metavar="SRC", show_default=False,
                                       help="Checkpoint directory to convert (official layout), or a hub model "
                                            "ORG/NAME (pulled when missing).")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="New directory to write the converted checkpoint to.")],
    quantization: Annotated[str, typer.Option("--quantization", metavar="FORMAT",
                                              help="Format to write: w8a8 (int8 weights per row).")] = "w8a8",
    shard_size: Annotated[float, typer.Option("--shard-size", metavar="GB", min=0.0001,
                                              help="Shard file size to aim for, in GB (a group the model "
                                                   "fuses, such as a layer's experts, is never split).")] = 4.0,
    revision: Annotated[Optional[str], typer.Option(
        "--revision", metavar="REV", show_default=False,
        help="With SRC ORG/NAME: the branch, tag or commit of the hub model [default: main]")] = None,
) -> None:
    """Convert a checkpoint (e.g. to w8a8) once, so that loading it needs no conversion work."""
    from dsv4.config import ConfigError
    from dsv4.daemon.process import ProgressBar
    from dsv4.model.checkpoint import CheckpointError
    from dsv4.model.convert import convert_checkpoint

    src_dir = model_dir(src, revision, "SRC")
    progress = ProgressBar("converting")
    try:
        counts = convert_checkpoint(src_dir, dst, quantization=quantization, shard_bytes=int(shard_size * 1e9),
                                    progress=progress)
    except (CheckpointError, ConfigError) as e:
        raise CliError(str(e)) from None
    finally:
        progress.close()
    O.err(f"dsv4: wrote {dst} ({quantization}; {counts})")


app.command("plan", short_help="Show the memory a configuration needs, before loading anything.")(plan)
app.command("pull", short_help="Download a model from the Hugging Face hub into its cache.",
            help="Download a hub model ORG/NAME into the Hugging Face hub cache (HF_HUB_CACHE): only the files "
                 "dsv4 reads, resuming an interrupted download, every file's hash checked against the hub's; "
                 "prints the snapshot's directory.")(pull)
app.command("models", short_help="List the models in the Hugging Face hub cache.",
            help="List the models in the Hugging Face hub cache: revision, size on disk, weight format, stored "
                 "weight bytes and whether they fit the memory available now.")(models)
app.command("draft-vocab", short_help="Write the MTP's draft vocabulary from text.",
            help="Rank the tokens of TEXT by frequency and write the MTP's draft vocabulary to --out "
                 "(serve with --draft-vocab FILE, or name it draft_vocab.json in the checkpoint).")(draft_vocab)


# ---------------------------------------------------------------------- helpers
# Errors of a model that cannot be loaded or a request that cannot run: one line, exit 1
_LOADING_ERRORS = [("dsv4.model.checkpoint", "CheckpointError", "checkpoint error: "),
                   ("dsv4.engine.tokenizer", "TokenizerError", "tokenizer error: "),
                   ("dsv4.config", "ConfigError", "model config error: "),
                   ("dsv4.engine.request", "RequestError", ""),
                   ("dsv4.engine.replicas.pool", "ReplicaError", "")]


def _exit_status(e: BaseException) -> tuple[int, str | None]:
    """Exit status and the one line to print for an exception."""
    from dsv4.daemon.client import DaemonError, DaemonTimeout, DaemonUnreachable
    from dsv4.daemon.paths import PathError, UnsafePathError
    from dsv4.daemon.protocol import ERR_INVALID_PARAMS

    ranks = sys.modules.get("dsv4.engine.parallel.ranks")  # loaded only if ranks ran (it imports torch)

    if isinstance(e, CliError):
        return e.code, str(e)
    hub = sys.modules.get("dsv4.hub.cache")  # loaded when a hub model was named
    if hub is not None and isinstance(e, hub.HubError):
        return e.code, str(e)
    if ranks is not None and isinstance(e, ranks.RankError):
        return O.EXIT_ERROR, str(e)
    if isinstance(e, DaemonUnreachable):
        return O.EXIT_UNAVAILABLE, str(e)
    if isinstance(e, (DaemonTimeout, TimeoutError)):
        return O.EXIT_TIMEOUT, str(e)
    if isinstance(e, DaemonError):
        return (O.EXIT_USAGE if e.code == ERR_INVALID_PARAMS else O.EXIT_ERROR), f"daemon: {e.message}"
    if isinstance(e, UnsafePathError):
        return O.EXIT_ERROR, str(e)
    if isinstance(e, PathError):
        return O.EXIT_USAGE, str(e)
    for module, name, prefix in _LOADING_ERRORS:  # the module is loaded when one of its errors was raised
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return O.EXIT_ERROR, f"{prefix}{e}"
    if isinstance(e, (KeyboardInterrupt, typer.Abort)):
        return O.EXIT_INTERRUPTED, None
    if isinstance(e, ClickException):
        return e.exit_code, e.format_message()
    if isinstance(e, OSError) and e.strerror:
        return O.EXIT_ERROR, f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return O.EXIT_ERROR, f"internal error: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    debug = os.environ.get("DSV4_DEBUG", "") not in ("", "0")
    try:
        rc = app(args=argv, prog_name="dsv4", standalone_mode=False)
        return rc if isinstance(rc, int) else O.EXIT_OK
    except NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
        return O.EXIT_USAGE
    except UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "dsv4"
        O.err(f"{cmd}: {e.format_message()} (see '{cmd} --help')")
        return O.EXIT_USAGE
    except typer.Exit as e:
        return e.exit_code
    except BaseException as e:  # noqa: BLE001  (SystemExit passes through below)
        if isinstance(e, SystemExit):
            raise
        code, line = _exit_status(e)
        if debug:
            traceback.print_exc()
        if line:
            O.err(line if line.startswith("dsv4") else f"dsv4: {line}")
        return code


if __name__ == "__main__":
    sys.exit(main())
