"""`dsv4 run`: one prompt in, generated text out, streamed as it comes.

The prompt comes from the argument, from `-` (stdin), or from piped stdin; with both
piped stdin and an argument, the prompt is stdin, a newline, then the argument. stdout
gets only the generated text (or, with `--json`, one JSON object at the end); stats go
to stderr with `--verbose`. `--show-drafts` colours tokens that were accepted MTP drafts
when stdout is a terminal. Ctrl-C cancels the request in the daemon (exit 130).
`--local` runs an engine in this process instead of talking to a daemon.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Annotated, Any, Iterator, Optional

import typer

from dsv4.cli import options as O
from dsv4.cli.options import CliError

DRAFT_COLOUR, RESET = "\x1b[32m", "\x1b[0m"


def run(
    prompt: Annotated[Optional[str], typer.Argument(
        metavar="[PROMPT|-]", help="The prompt; '-' reads it from stdin. Piped stdin comes before PROMPT.",
        show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", metavar="N", callback=O.int_range(1), help="Most tokens to generate.")]
    = 256,
    temperature: Annotated[Optional[float], typer.Option(
        "--temperature", metavar="T", min=0.0, show_default=False, callback=O.finite,
        help="Sampling temperature; 0 = greedy [default: the model's generation_config.json, else 0]")] = None,
    top_p: Annotated[Optional[float], typer.Option(
        "--top-p", metavar="P", min=0.0, max=1.0, show_default=False, callback=O.finite,
        help="Nucleus sampling: keep the top tokens with this much mass [default: the model's, else 1 = off]")]
    = None,
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", metavar="K", callback=O.int_range(0), show_default=False,
        help="Keep the K most likely tokens; 0 = all [default: the model's, else 0]")] = None,
    min_p: Annotated[Optional[float], typer.Option(
        "--min-p", metavar="P", min=0.0, max=1.0, show_default=False, callback=O.finite,
        help="Keep tokens with probability >= P times the top one; 0 = off [default: the model's, else 0]")]
    = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(
        "--repetition-penalty", metavar="R", show_default=False, callback=O.finite,
        help="Divide the logits of tokens already in the prompt or output by R (> 1 discourages repeats) "
             "[default: the model's, else 1 = off]")] = None,
    presence_penalty: Annotated[Optional[float], typer.Option(
        "--presence-penalty", metavar="P", show_default=False, callback=O.finite,
        help="Subtract P from tokens already generated, -2..2 [default: the model's, else 0]")] = None,
    frequency_penalty: Annotated[Optional[float], typer.Option(
        "--frequency-penalty", metavar="F", show_default=False, callback=O.finite,
        help="Subtract F per earlier occurrence in the output, -2..2 [default: the model's, else 0]")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", metavar="N", callback=O.int_range(0, O.MAX_SEED),
                                                help="Seed for sampling (reproducible output), 0..2^64-1.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", metavar="TEXT",
                                                      help="Stop when TEXT is generated (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")] = False,
    no_mtp: Annotated[bool, typer.Option("--no-mtp", help="No speculative (MTP) drafts for this request.")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="System prompt (chat mode).")]
    = None,
    think: Annotated[bool, typer.Option("--think", help="Thinking mode: the answer starts with <think>.")] = False,
    tools: O.Tools = None, tool_choice: O.ToolChoice = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of streaming.")]
    = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print timings and MTP statistics to stderr.")]
    = False,
    show_drafts: Annotated[bool, typer.Option("--show-drafts", help="On a terminal, colour accepted MTP draft "
                                              "tokens (green) apart from target-model tokens.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", min=0,
                                           callback=O.finite, help="Give up after this long (exit 75); 0 = no limit.")] = 0.0,
    socket: O.Socket = None, api_key: O.ApiKey = None,
    local: Annotated[bool, typer.Option("--local", help="Run an engine in this process (takes the engine options "
                                        "of 'dsv4 serve') instead of using the daemon.")] = False,
    model: O.Model = None, device: O.Device = None, dtype: O.Dtype = None, max_num_seqs: O.MaxNumSeqs = None,
    max_model_len: O.MaxModelLen = None, max_num_batched_tokens: O.MaxBatched = None,
    long_prefill_token_threshold: O.LongPrefill = None, enable_chunked_prefill: O.Chunked = None,
    num_speculative_tokens: O.NumSpec = None, profile: O.Profile = None, threads: O.Threads = None,
    quantization: O.Quantization = None, compile: O.Compile = None, kv_cache_memory: O.KvCacheMemory = None,
    enable_prefix_caching: O.PrefixCaching = None, tensor_parallel_size: O.TensorParallel = None,
    draft_vocab: O.DraftVocab = None, revision: O.Revision = None,
) -> None:
    local = local or O.under_torchrun()  # under torchrun every process is a rank of one engine
    engine = O.local_engine_kwargs(
        local, model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill, num_speculative_tokens=num_speculative_tokens,
        profile_dir=profile, threads=threads, quantization=quantization, compile=compile,
        kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size, draft_vocab=draft_vocab, revision=revision)
    if raw and (system is not None or think or tools is not None):
        raise CliError("--system, --think and --tools need the chat template; drop --raw", O.EXIT_USAGE)
    tool_list, choice = O.read_tool_options(tools, tool_choice)
    if local:
        from dsv4.cli.hub import fetch_model

        fetch_model(engine)  # --model ORG/NAME: pulled when missing, then found in the cache
        O.torchrun_follower(engine)  # under torchrun, RANK > 0 follows rank 0's steps here and exits
    params: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "speculative": not no_mtp}
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
             "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty}
    params.update({k: v for k, v in given.items() if v is not None})  # the rest: the model's defaults
    if seed is not None:
        params["seed"] = seed
    if prompt is None and not local and not as_json and _isatty(sys.stdin) and _isatty(sys.stdout):
        from dsv4.cli.chat import run_chat  # no prompt on a terminal: an interactive session

        raise typer.Exit(run_chat(socket, system, think, params, api_key, tool_list, choice))
    text = read_prompt(prompt)
    if stop:
        params["stop"] = list(stop)
    if tool_list is not None:
        from dsv4.cli.tools import tool_params

        params.update(tool_params(tool_list, choice))
        if choice == "none":  # as the API does it: the tools are not rendered, no call is parsed
            tool_list = None
    request = dict(prompt=text, params=params, mode="raw" if raw else "auto", system=system, thinking=think,
                   tools=tool_list)
    out = Output(as_json=as_json, show_drafts=show_drafts, tools=tool_list, thinking=think)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    signal.signal(signal.SIGTERM, _interrupt)
    if local:
        code = out.drive(_local_events(engine, request, out.colour, on_loaded=out.loaded), on_interrupt=None)
    else:
        code = out.drive_daemon(request, socket, deadline, api_key)
    if verbose:
        out.print_stats()
    raise typer.Exit(code)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def read_prompt(arg: str | None) -> str:
    """The prompt from `arg`, '-', or piped stdin (stdin first, then the argument).

    Bytes that are not UTF-8 (in stdin or the argument) become U+FFFD; an empty prompt is a usage error."""
    stdin = sys.stdin
    piped = stdin is not None and not _isatty(stdin)
    if arg is not None:
        arg = arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if arg == "-":
        if stdin is None:
            raise CliError("'-' reads the prompt from stdin, but there is no stdin", O.EXIT_USAGE)
        return _nonempty(_read_text(stdin))
    data = _read_text(stdin) if piped else ""
    if arg is None:
        if not data:
            raise CliError("no prompt: give it as an argument, as '-' to read stdin, or pipe it in", O.EXIT_USAGE)
        return data
    if data:
        return data + ("" if data.endswith("\n") else "\n") + arg
    return _nonempty(arg)


def _read_text(f: Any) -> str:
    """All of `f` as text, invalid UTF-8 replaced (U+FFFD) rather than an error."""
    buf = getattr(f, "buffer", None)
    if buf is None:
        return f.read()
    return buf.read().decode("utf-8", "replace")


def _nonempty(text: str) -> str:
    if not text:
        raise CliError("the prompt is empty; give at least one character", O.EXIT_USAGE)
    return text


def _isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


class Output:
    """Renders events (delta ..., final) to stdout and collects what `--json` and `--verbose` print."""

    def __init__(self, *, as_json: bool, show_drafts: bool, tools: list[Any] | None = None,
                 thinking: bool = False) -> None:
        self.as_json = as_json
        self.tools = None  # --tools: the answer's DSML becomes tool calls (dsv4/cli/tools.py)
        if tools:
            from dsv4.cli.tools import ToolText

            self.tools = ToolText(tools, thinking)
        self.colour = show_drafts and not as_json and _isatty(sys.stdout) and not tools
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.sources: list[str] = []
        self.final: dict[str, Any] = {}
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self._char_src: list[str] = []  # per character of the per-token pieces: draft/target
        self._printed = 0
        self._shown = ""  # the last text written to stdout
        self.load_s: float | None = None  # --local: model load time, kept out of TTFT

    # ------------------------------------------------------------------ driving
    def drive_daemon(self, request: dict[str, Any], socket: str | None, deadline: float | None,
                     api_key: str | None = None) -> int:
        """Send the request to the daemon and stream its events; returns the exit status."""
        from dsv4.daemon.client import Client, DaemonTimeout
        from dsv4.daemon.paths import resolve_endpoint

        with Client(resolve_endpoint(socket), api_key=api_key) as client:
            client.connect(deadline=deadline)
            self.t0 = time.monotonic()
            rid = client.generate(request["prompt"], request["params"], mode=request["mode"],
                                  system=request["system"], thinking=request["thinking"], pieces=self.colour,
                                  tools=request.get("tools"))
            try:
                return self.drive(client.stream(rid, deadline), on_interrupt=lambda: client.cancel(rid))
            except DaemonTimeout:
                client.cancel(rid)
                raise DaemonTimeout("timed out waiting for the generation (see --timeout)") from None

    def drive(self, events: Iterator[dict[str, Any]], on_interrupt: Any) -> int:
        """Render `events` until the final one; returns the exit status."""
        try:
            for msg in events:
                if msg["type"] == "delta":
                    self.on_delta(msg)
                elif msg["type"] == "final":
                    self.final = msg
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt()
            self._end_line()
            return O.EXIT_INTERRUPTED
        except BrokenPipeError:  # `dsv4 run ... | head`: the reader is done
            if on_interrupt is not None:
                on_interrupt()
            _silence_stdout()
            return O.EXIT_OK
        self.t_end = time.monotonic()
        if self.tools is not None:
            self._write(self.tools.finish(cut=self.final.get("finish_reason") == "length"))
        if self.as_json:
            print(json.dumps(self.result(), ensure_ascii=False))
        else:
            self._end_line()
            for call in self.tools.calls if self.tools is not None else ():
                print(json.dumps(call, ensure_ascii=False))
        if self.final.get("finish_reason") in ("error", "abort") and self.final.get("error"):
            O.err(f"dsv4: {self.final['error']}")
            return O.EXIT_ERROR
        return O.EXIT_OK

    # ------------------------------------------------------------------ rendering
    def on_delta(self, msg: dict[str, Any]) -> None:
        ids, sources, text = list(msg.get("token_ids") or []), list(msg.get("sources") or []), msg.get("text") or ""
        if ids and self.t_first is None:
            self.t_first = time.monotonic()
        self.token_ids += ids
        self.sources += sources
        self.text.append(text)
        if self.tools is not None:
            text = self.tools.feed(text)
        if self.colour:
            text = self._coloured(text, msg.get("pieces") or [], sources)
        self._write(text)

    def _write(self, text: str) -> None:
        if self.as_json or not text:
            return
        self._shown = text
        sys.stdout.write(text)
        sys.stdout.flush()

    def _coloured(self, text: str, pieces: list[str], sources: list[str]) -> str:
        """Colour each character by the source of the token whose piece produced it."""
        for piece, src in zip(pieces, sources):
            self._char_src.extend([src] * len(piece))
        out, current = [], "target"
        for i, ch in enumerate(text):
            pos = self._printed + i
            src = self._char_src[pos] if pos < len(self._char_src) else "target"
            if src != current:
                out.append(DRAFT_COLOUR if src == "draft" else RESET)
                current = src
            out.append(ch)
        self._printed += len(text)
        if current != "target":
            out.append(RESET)
        return "".join(out)

    def _end_line(self) -> None:
        if not self.as_json and (_isatty(sys.stdout) or self.tools is not None) and self._shown \
                and not self._shown.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()

    # ------------------------------------------------------------------ results
    def timings(self) -> dict[str, float | None]:
        """Client-side TTFT/TPOT/E2E (docs/serving.md section 4)."""
        end = self.t_end if self.t_end is not None else time.monotonic()
        ttft = None if self.t_first is None else self.t_first - self.t0
        e2e = end - self.t0
        n = len(self.token_ids)
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
        return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}

    def result(self) -> dict[str, Any]:
        f = self.final
        spec = dict(f.get("spec") or {})
        for key in ("drafted", "accepted", "acceptance_rate", "mean_acceptance_length"):
            spec.setdefault(key, 0 if key in ("drafted", "accepted") else None)
        usage = f.get("usage") or {"prompt_tokens": None, "completion_tokens": len(self.token_ids)}
        reason = f.get("finish_reason")
        tools: dict[str, Any] = {}
        if self.tools is not None:  # the text without the DSML, and the calls in it
            tools = {"content": self.tools.content, "tool_calls": self.tools.calls}
            reason = self.tools.finish_reason if reason != "length" and self.tools.finish_reason else reason
        return {"text": "".join(self.text), **tools, "token_ids": self.token_ids, "finish_reason": reason,
                "error": f.get("error"), "usage": usage, "timings": self.timings(),
                "server_timings": f.get("timings"), "spec": spec,
                # what ran compiled (--compile); null from a daemon older than these keys
                "compiled": f.get("compiled"), "compiled_buckets": f.get("compiled_buckets")}

    def loaded(self) -> None:
        """--local: the model is loaded; timings start now (load time is reported apart)."""
        now = time.monotonic()
        self.load_s = now - self.t0
        self.t0 = now

    def print_stats(self) -> None:
        r = self.result()
        t, s, u = r["timings"], r["spec"], r["usage"]
        ms = lambda v: "-" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
        rate = f"{1 / t['tpot_s']:.1f} tok/s" if t["tpot_s"] else "-"
        acc = "-" if s.get("acceptance_rate") is None else f"{s['acceptance_rate']:.1%}"
        mal = "-" if s.get("mean_acceptance_length") is None else f"{s['mean_acceptance_length']:.2f}"
        load = f"model loaded in {self.load_s:.2f} s; " if self.load_s is not None else ""
        O.err(f"{load}prompt {u.get('prompt_tokens')} tokens, generated {u.get('completion_tokens')} tokens, "
              f"finish {r['finish_reason']}; TTFT {ms(t['ttft_s'])}, TPOT {ms(t['tpot_s'])} ({rate}), "
              f"E2E {ms(t['e2e_s'])}; MTP drafted {s.get('drafted')}, accepted {s.get('accepted')} ({acc}), "
              f"mean acceptance length {mal}")


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _local_events(kw: dict[str, Any], request: dict[str, Any], pieces: bool,
                  on_loaded: Any = None) -> Iterator[dict[str, Any]]:
    """The same events as the daemon sends, from an engine in this process; `on_loaded()`
    is called once the model is loaded, before the request is added."""
    from dsv4.daemon import protocol as P
    from dsv4.daemon.process import load_engine
    from dsv4.engine.llm import LLM
    from dsv4.engine.request import RequestError
    from dsv4.engine.sampling import SamplingParams

    config = O.build_config(kw)
    try:
        params = SamplingParams.from_dict({**config.sampling_defaults, **request["params"]})
    except RequestError as e:
        raise CliError(str(e), O.EXIT_USAGE) from None
    llm = LLM.from_engine(load_engine(config))
    if on_loaded is not None:
        on_loaded()
    tok = llm.engine.tokenizer
    detok = tok.detokenizer() if pieces and tok is not None else None
    try:
        for out in llm.stream(request["prompt"], params, prompt_mode=request["mode"], system=request["system"],
                              thinking=request["thinking"], tools=request.get("tools")):
            yield from P.output_messages(out.request_id, out, detok)
    except RequestError as e:  # the prompt refused (too long, bad tools): one line
        raise CliError(str(e)) from None
    finally:
        llm.close()
