"""`dsv4 chat` (and `dsv4 run` with no prompt on a terminal): an interactive session with the daemon.

    >>> Who art thou?          a turn: the whole conversation goes to the daemon, the answer streams
    >>> /set temperature 0.7   change a sampling parameter for the next turns (/set shows them)
    >>> /clear                 forget the conversation
    >>> /bye                   leave (Ctrl-D too)

With `--tools FILE` the calls an answer makes print as `[tool call ID] NAME ARGUMENTS` lines
and the session asks for each call's result (`NAME> `), then sends them back, as an agent
loop does. A model with DeepSeek's chat tokens gets the conversation rendered with its chat
template (`Tokenizer.encode_chat`); one without them continues the transcript. Ctrl-C while
an answer streams cancels that answer and the session goes on; Ctrl-C at the prompt clears
the line. Details: docs/agents.md, 'dsv4/cli/chat.py'.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

from typing import Annotated

import typer

from dsv4.agents.prompts import has_template
from dsv4.cli import options as O
from dsv4.cli.options import CliError

PROMPT = ">>> "
HELP = ("commands: /set NAME VALUE (temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, "
        "frequency_penalty, max_tokens, seed), /set (show), /clear, /bye")
SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
            "presence_penalty": float, "frequency_penalty": float, "max_tokens": int, "seed": int}


class Session:
    """The conversation and the parameters of one chat; `turn(text)` returns the prompt to send."""

    def __init__(self, tokenizer: Any, system: str | None = None, thinking: bool = False,
                 tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto") -> None:
        self.tokenizer, self.system, self.thinking = tokenizer, system, thinking
        self.tools, self.tool_choice = tools, tool_choice
        from dsv4.cli.tools import tool_params

        self.forced = tool_params(tools, tool_choice)  # what a forced choice adds to the user's turns
        self.template = has_template(tokenizer)
        self.messages: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []  # the last answer's tool calls still waiting for a result
        self.params: dict[str, Any] = {"max_tokens": 256}

    def clear(self) -> None:
        self.messages, self.pending = [], []

    def command(self, line: str) -> str | None:
        """Run a /command; returns what to print, or None for /bye. Raises ValueError on a bad one."""
        parts = line.split()
        name = parts[0].lower()
        if name in ("/bye", "/exit", "/quit"):
            return None
        if name == "/clear":
            self.clear()
            return "(conversation cleared)"
        if name == "/set":
            if len(parts) == 1:
                return ", ".join(f"{k} {v}" for k, v in self.params.items()) + " (others: the model's defaults)"
            if len(parts) != 3 or parts[1] not in SETTABLE:
                raise ValueError(f"usage: /set NAME VALUE with NAME one of {', '.join(SETTABLE)}")
            name, kind = parts[1], SETTABLE[parts[1]]
            try:
                value = kind(parts[2])
            except ValueError:
                raise ValueError(f"{name} takes {'an integer' if kind is int else 'a number'}, "
                                 f"got {parts[2]!r}") from None
            check_params({**self.params, name: value})
            self.params[name] = value
            return f"{name} = {value}"
        if name in ("/help", "/?"):
            return HELP
        raise ValueError(f"unknown command {name}; {HELP}")

    def prompt(self, user_text: str | None) -> tuple[str | list[int], str]:
        """The prompt for the conversation plus `user_text` (None: after tool results), and its
        mode (raw)."""
        from dsv4.agents.encoding import EncodingError
        from dsv4.agents.prompts import chat_prompt
        from dsv4.engine.tokenizer import TokenizerError

        msgs = self.messages + ([{"role": "user", "content": user_text}] if user_text is not None else [])
        if self.template and self.system:
            msgs = [{"role": "system", "content": self.system}] + msgs
        options = {"tools": self.tools, "tool_choice": self.tool_choice} if self.tools else {}
        try:
            return chat_prompt(self.tokenizer, msgs, thinking=self.thinking and self.template, **options), "raw"
        except EncodingError as e:
            raise TokenizerError(str(e)) from None

    def turn_params(self, user_text: str | None) -> dict[str, Any]:
        """The sampling parameters of a turn: a forced tool call on the user's turns only."""
        return {**self.params, **(self.forced if user_text is not None else {})}

    def answered(self, user_text: str | None, answer: str, reasoning: str = "",
                 calls: list[dict[str, Any]] | None = None) -> None:
        """The answer to `user_text` (None: to tool results), with its reasoning (kept in the
        history when tools are on, as DeepSeek's encoding does) and its tool calls, which now
        wait for their results (`tool_result`)."""
        if user_text is not None:
            self.messages.append({"role": "user", "content": user_text})
        msg: dict[str, Any] = {"role": "assistant", "content": answer}
        if reasoning and self.tools:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        self.messages.append(msg)
        self.pending = list(calls or [])

    def tool_result(self, text: str) -> bool:
        """The result of the first waiting call; True when every call has its result (the
        model goes on)."""
        call = self.pending.pop(0)
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        return not self.pending


def check_params(params: dict[str, Any]) -> None:
    """Refuse sampling parameters the daemon would refuse (`SamplingParams` validation,
    ValueError with its message), when they are set rather than at the next turn."""
    from dsv4.engine.errors import RequestError
    from dsv4.engine.sampling import SamplingParams  # imports torch: only once something is /set

    try:
        SamplingParams.from_dict(params)
    except RequestError as e:
        raise ValueError(f"refused: {e}") from None


def _readline() -> Callable[[str], str]:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover
        pass
    return input


def run_chat(socket: str | None, system: str | None = None, thinking: bool = False,
             params: Optional[dict[str, Any]] = None, api_key: str | None = None,
             tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto") -> int:
    """The interactive loop against the daemon; returns the exit status."""
    from dsv4.daemon.client import Client
    from dsv4.daemon.paths import resolve_endpoint
    from dsv4.agents.prompts import no_template
    from dsv4.engine.tokenizer import Tokenizer, TokenizerError

    read = _readline()
    with Client(resolve_endpoint(socket), api_key=api_key) as client:
        client.connect()
        model = str(client.status().get("model") or "")
        try:
            tokenizer = Tokenizer.from_dir(model) if model and Path(model).is_dir() else None
        except TokenizerError:
            tokenizer = None
        session = Session(tokenizer, system, thinking, tools, tool_choice)
        if (system is not None or thinking or tools) and not session.template:
            flag, what = ("--tools", "tools") if tools else ("--think", "thinking mode") if thinking else \
                ("--system", "system prompt")
            raise CliError(f"{flag}: {no_template(what)}", O.EXIT_USAGE)
        session.params.update(params or {})
        O.err(f"dsv4 chat with {Path(model).name or 'the daemon'} "
              f"({'chat template' if session.template else 'plain continuation'}"
              f"{f', {len(tools)} tool(s)' if tools else ''}); /bye to leave, /? for help")
        while True:
            waiting = session.pending[0]["function"]["name"] if session.pending else None
            try:
                line = read(f"{waiting}> " if waiting else PROMPT)
            except EOFError:
                print(file=sys.stderr)
                return O.EXIT_OK
            except KeyboardInterrupt:
                print("^C", file=sys.stderr)
                continue
            text = line.strip()
            if not text and not waiting:
                continue
            if text.startswith("/"):
                try:
                    out = session.command(text)
                except ValueError as e:
                    O.err(str(e))
                    continue
                if out is None:
                    return O.EXIT_OK
                O.err(out)
                continue
            if waiting:  # the line is that tool's result; the model goes on once every call has one
                if not session.tool_result(line):
                    continue
                text = None
            _answer(client, session, text)


def _answer(client: Any, session: Session, user_text: str | None) -> None:
    """One turn: stream the answer to `user_text` (None: to tool results), its tool calls
    as lines after it; Ctrl-C cancels it."""
    from dsv4.cli.tools import ToolText, call_line
    from dsv4.daemon.client import DaemonError

    prompt, mode = session.prompt(user_text)
    parts = ToolText(session.tools, session.thinking) if session.tools else None
    answer: list[str] = []
    rid, final = None, {}
    try:
        rid = client.generate(prompt, session.turn_params(user_text), mode=mode)
        for msg in client.stream(rid):
            if msg["type"] == "delta":
                piece = msg.get("text") or ""
                answer.append(piece)
                sys.stdout.write(parts.feed(piece) if parts is not None else piece)
                sys.stdout.flush()
            elif msg.get("error"):
                O.err(f"\ndsv4: {msg['error']}")
            else:
                final = msg
        if parts is not None:
            sys.stdout.write(parts.finish(cut=final.get("finish_reason") == "length"))
            print()
            for call in parts.calls:
                print(call_line(call))
            session.answered(user_text, parts.content, parts.reasoning, parts.calls)
        else:
            print()
            session.answered(user_text, "".join(answer))
    except KeyboardInterrupt:
        if rid is not None:
            client.cancel(rid)
        print("\n(answer cancelled)", file=sys.stderr)
    except DaemonError as e:
        O.err(f"dsv4: {e.message}" + (" (/clear starts over)" if "max_model_len" in e.message else ""))


def chat(
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT",
                                                  help="System prompt (models with a chat template).")] = None,
    think: Annotated[bool, typer.Option("--think", help="Thinking mode (models with a chat template).")] = False,
    temperature: Annotated[Optional[float], typer.Option(
        "--temperature", metavar="T", min=0.0, show_default=False, callback=O.finite,
        help="Sampling temperature; 0 = greedy [default: the model's generation_config.json, else 0]")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", metavar="N", callback=O.int_range(1),
                                            help="Most tokens per answer.")] = 256,
    tools: O.Tools = None, tool_choice: O.ToolChoice = "auto",
    socket: O.Socket = None, api_key: O.ApiKey = None,
) -> None:
    if not sys.stdin.isatty():
        raise CliError("dsv4 chat needs a terminal; use 'dsv4 run' in pipelines", O.EXIT_USAGE)
    tool_list, choice = O.read_tool_options(tools, tool_choice)
    params: dict[str, Any] = {"max_tokens": max_tokens}
    if temperature is not None:
        params["temperature"] = temperature
    raise typer.Exit(run_chat(socket, system, think, params, api_key, tool_list, choice))
