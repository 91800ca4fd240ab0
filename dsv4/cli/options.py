"""Pieces shared by the CLI commands: exit statuses, the CLI error type, engine options.

Engine flags map one to one onto `dsv4.engine.config.EngineConfig` fields; a flag left
out is not passed, so the config's own defaults (resolved from the checkpoint) apply.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

import dsv4

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: no daemon
EXIT_TIMEOUT = 75  # EX_TEMPFAIL
EXIT_INTERRUPTED = 130

ENGINE_PANEL = "Engine options"


class CliError(Exception):
    """A failure to report as one stderr line with an exit status."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def err(msg: str) -> None:
    """One line on stderr."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- option types
Socket = Annotated[Optional[str], typer.Option(
    "--socket", metavar="ENDPOINT",
    help="Daemon endpoint: ipc:///path/to/socket, a socket path, or tcp://HOST:PORT "
         "[default: $DSV4_SOCKET, else ipc://$XDG_RUNTIME_DIR/dsv4/dsv4.sock]")]
Model = Annotated[Optional[Path], typer.Option(
    "--model", metavar="DIR", rich_help_panel=ENGINE_PANEL,
    help="Checkpoint directory (config.json, *.safetensors, tokenizer.json) [default: the embedded "
         "tiny-shakespeare model]")]
Device = Annotated[Optional[str], typer.Option(
    "--device", metavar="DEVICE", rich_help_panel=ENGINE_PANEL, help="cpu, cuda, cuda:N or npu [default: cpu]")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="DTYPE", rich_help_panel=ENGINE_PANEL,
    help="auto, float32, bfloat16 or float16 [default: auto = float32 on cpu, bfloat16 otherwise]")]
MaxNumSeqs = Annotated[Optional[int], typer.Option(
    "--max-num-seqs", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Most requests running at once (state slots) [default: 8]")]
MaxModelLen = Annotated[Optional[int], typer.Option(
    "--max-model-len", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Most tokens (prompt + output) of one request [default: min(model maximum, 2048)]")]
MaxBatched = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Token budget of one engine step [default: prefill limit + max-num-seqs * (1 + K)]")]
LongPrefill = Annotated[Optional[int], typer.Option(
    "--long-prefill-token-threshold", metavar="N", rich_help_panel=ENGINE_PANEL,
    help="Lower the prefill chunk size below the model's prefill limit (0 = no extra limit) [default: 0]")]
Chunked = Annotated[Optional[bool], typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", rich_help_panel=ENGINE_PANEL, show_default=False,
    help="Split long prompts into chunks of at most the prefill limit; off = each prompt in one dispatch "
         "[default: on]")]
NumSpec = Annotated[Optional[str], typer.Option(
    "--num-speculative-tokens", metavar="K", rich_help_panel=ENGINE_PANEL,
    help="MTP drafts per decode step, 0 = off; auto = 0..3 chosen each step from measured step costs and "
         "the acceptance rate [default: auto when the checkpoint has MTP weights, else 0]")]
EngineSeed = Annotated[Optional[int], typer.Option(
    "--seed", metavar="N", rich_help_panel=ENGINE_PANEL, help="Engine random seed [default: 0]")]
Profile = Annotated[Optional[Path], typer.Option(
    "--profile", metavar="DIR", rich_help_panel=ENGINE_PANEL, envvar="DSV4_PROFILE_DIR", show_envvar=False,
    help="Write torch profiler traces of engine steps (prefill chunks, verify, MTP) into DIR; off by default "
         "[env: DSV4_PROFILE_DIR]")]

# flag -> EngineConfig field
ENGINE_FLAGS = {
    "model": "--model", "device": "--device", "dtype": "--dtype", "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len", "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "enable_chunked_prefill": "--enable-chunked-prefill", "num_speculative_tokens": "--num-speculative-tokens",
    "seed": "--seed", "profile_dir": "--profile",
}


def engine_kwargs(**given: Any) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags given (None = not given); --model defaults to the asset."""
    kw = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
    kw.setdefault("model", str(dsv4.DEFAULT_MODEL))
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
        if key == "enable_chunked_prefill":
            argv.append(flag if value else "--no-enable-chunked-prefill")
        else:
            argv += [flag, str(value)]
    return argv


def build_config(kw: dict[str, Any]) -> Any:
    """A validated EngineConfig, or `CliError` (usage) with the validation message; loads no weights."""
    from dsv4.engine.config import EngineConfig, EngineConfigError

    try:
        return EngineConfig.create(**kw)
    except EngineConfigError as e:
        raise CliError(str(e), EXIT_USAGE) from None
