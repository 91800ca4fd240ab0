"""DeepSeek V4's prompt encoding: OpenAI-style chat messages -> prompt pieces -> token ids.

V4 ships no Jinja template; DeepSeek's published encoder (`encoding_dsv4.py`) builds the
prompt in code, and this module follows its rules (written anew here): BOS once, system
text bare, `<｜User｜>` turns, `<｜Assistant｜>` + `<think>` or `</think>`, tools as a
"## Tools" block, assistant `tool_calls` as DSML, tool results as `<tool_result>` blocks of
a user turn, reasoning dropped before the last user turn unless tools are rendered,
`reasoning_effort` preambles; unlike DeepSeek's, it always asks for a new assistant turn.

A prompt is a list of pieces: `str` (text, encoded as plain text, so no message, name,
argument or schema can produce a special token) or `Special` (one token, inserted by id).
`render` builds the pieces, `to_ids` turns them into ids with any tokenizer that has
`encode(text)` and `token_to_id(token)`, `to_text` into the prompt string; bad input raises
`EncodingError` (one line, naming its request field). Rules: docs/agents.md, 'dsv4/agents/encoding.py'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, Union

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"  # a token of its own in V4's vocabulary, inside the `<…>` of the markup

EFFORT_PREAMBLES = {
    "high": "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
            "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
            "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
            "adversarial scenarios.\n"
            "Explicitly write out your entire deliberation process, documenting every intermediate step, "
            "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
            "unchecked.\n\n",
    "max": "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
           "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
           "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
           "resolve the underlying cause rather than any surface symptom.\n"
           "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
           "certain that no assumption remains unchecked and no error remains undiscovered.\n\n",
}
# accepted reasoning_effort values -> the level rendered ("none": chat mode; "low": no preamble)
EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "low", "high": "high", "xhigh": "max",
           "max": "max"}

_TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
_SPECIALS_IN_TEMPLATES = re.compile(f"({re.escape(THINK)}|{re.escape(THINK_END)}|{re.escape(DSML)})")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
ROLES = ("system", "developer", "user", "assistant", "tool")


class EncodingError(ValueError):
    """A conversation or option the encoder cannot render (one-line message; `param`: the request field)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Special:
    """One special token, inserted by id. `optional`: its text (plain) where the vocabulary lacks it."""

    token: str
    optional: bool = False


Piece = Union[str, Special]


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class ChatOptions:
    """What besides the messages shapes a prompt (the chat request's fields)."""

    thinking: bool = False
    reasoning_effort: str | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    response_format: Mapping[str, Any] | None = None
    add_bos: bool = True


@dataclass
class _Turn:
    role: str  # system, user or assistant
    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # assistant: its calls' ids
    blocks: list[tuple[str | None, str]] = field(default_factory=list)  # user: (tool_call_id or None, text)
    extra: list[Piece] = field(default_factory=list)  # system: the tools block, the response format note


def effort_level(value: Any) -> str | None:
    """The level of a `reasoning_effort` value ("none", "low", "high", "max"), None when unset."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORTS:
        raise EncodingError(f"reasoning_effort must be one of {', '.join(EFFORTS)}; got {value!r:.40}",
                            "reasoning_effort")
    return EFFORTS[value]


def thinking_mode(switch: bool | None, reasoning_effort: Any) -> bool:
    """Thinking on or off: `reasoning_effort` "none" turns it off, an explicit switch decides,
    else any other effort turns it on (as DeepSeek's API does), else off."""
    level = effort_level(reasoning_effort)
    if level == "none":
        return False
    if switch is not None:
        return switch
    return level is not None


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The `function` objects of OpenAI `tools` (EncodingError for anything else)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise EncodingError("tools must be a list of function tools", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise EncodingError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise EncodingError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . : or -; "
                                f"got {name!r:.70}", "tools")
        if name in names:
            raise EncodingError(f"tools[{i}]: a second function named {name!r}", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise EncodingError(f"tools[{i}].function.description must be a string", "tools")
        _check_schema(fn.get("parameters"), f"tools[{i}].function.parameters")
        names.add(name)
        functions.append(fn)
    return functions


def _check_schema(schema: Any, where: str) -> None:
    """A function's parameters: a JSON schema object (of type object, when it says)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise EncodingError(f"{where} must be a JSON schema object", "tools")
    if schema.get("type", "object") != "object":
        raise EncodingError(f'{where}.type must be "object"; got {schema["type"]!r:.40}', "tools")
    props, required = schema.get("properties"), schema.get("required")
    if props is not None and not (isinstance(props, dict) and all(isinstance(v, (dict, bool)) for v in props.values())):
        raise EncodingError(f"{where}.properties must map names to schemas", "tools")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise EncodingError(f"{where}.required must be a list of names", "tools")


def check_tool_choice(choice: Any, functions: Sequence[Mapping[str, Any]]) -> str:
    """"auto", "none", "required", or the name of the function a named choice forces."""
    names = [f["name"] for f in functions]
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise EncodingError('tool_choice "required" needs tools', "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise EncodingError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                            f'{{"name": ...}}}}; got {choice!r:.60}', "tool_choice")
    if fn["name"] not in names:
        raise EncodingError(f"tool_choice names the function {fn['name']!r:.70}, which is not among the tools",
                            "tool_choice")
    return fn["name"]


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise EncodingError(f"{where}.content must be a string or a list of text parts")


def _calls(msg: Mapping[str, Any], where: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """An assistant message's tool calls as (name, arguments) and their ids."""
    raw = msg.get("tool_calls")
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise EncodingError(f"{where}.tool_calls must be a list")
    calls, ids = [], []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise EncodingError(f"{where}.tool_calls[{j}] must have a function with a name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise EncodingError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise EncodingError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise EncodingError(f"{where}.tool_calls[{j}].id must be a string")
        calls.append((fn["name"], args))
        ids.append(call_id or "")
    return calls, ids


def _turns(messages: Sequence[Mapping[str, Any]]) -> list[_Turn]:
    """Messages -> turns: developer as system, runs of user/tool messages as one user turn,
    tool results checked against and ordered by the calls of the assistant that made them."""
    if not messages:
        raise EncodingError("messages must not be empty")
    turns: list[_Turn] = []
    last_calls: list[str] | None = None  # the ids of the latest assistant's calls
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, Mapping) else None
        if role not in ROLES:
            raise EncodingError(f"{where}.role {role!r:.30} is not one of {', '.join(ROLES)}")
        text = _text(msg.get("content"), where)
        if role in ("user", "tool"):
            block: tuple[str | None, str] = (None, text)
            if role == "tool":
                tid = msg.get("tool_call_id")
                if last_calls is None or not isinstance(tid, str) or not tid or tid not in last_calls:
                    raise EncodingError(f"{where}: tool_call_id {tid!r:.50} matches no tool call of the assistant "
                                        "message before it")
                block = (tid, text)
            if turns and turns[-1].role == "user":
                turns[-1].blocks.append(block)
            else:
                turns.append(_Turn("user", blocks=[block]))
        elif role == "assistant":
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise EncodingError(f"{where}.reasoning_content must be a string")
            calls, ids = _calls(msg, where)
            turns.append(_Turn("assistant", text=text, reasoning=reasoning or "", calls=calls, ids=ids))
            if calls:
                last_calls = ids
        else:
            turns.append(_Turn("system", text=text))
    order: dict[str, int] = {}
    for t in turns:
        if t.role == "assistant" and t.calls:
            order = {cid: k for k, cid in reversed(list(enumerate(t.ids)))}
        elif t.role == "user":
            slots = [k for k, (tid, _) in enumerate(t.blocks) if tid is not None]
            ranked = sorted((t.blocks[k] for k in slots), key=lambda b: order.get(b[0] or "", 0))
            for k, b in zip(slots, ranked):
                t.blocks[k] = b
    return turns


def _template(text: str) -> list[Piece]:
    """Trusted template text with its `<think>`, `</think>`, `｜DSML｜` as special tokens."""
    parts = _SPECIALS_IN_TEMPLATES.split(text)
    return [Special(p, optional=p == DSML) if k % 2 else p for k, p in enumerate(parts) if p]


def dumps(value: Any) -> str:
    """JSON as DeepSeek's encoder writes it, and the tool-call arguments too (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def _tool_calls(calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Piece]:
    """`\\n\\n<｜DSML｜tool_calls>` … `</｜DSML｜tool_calls>`: names, keys and values as plain text."""
    out: list[Piece] = _template(f"\n\n<{DSML}tool_calls>\n")
    for k, (name, args) in enumerate(calls):
        out += _template(f"\n<{DSML}invoke name=\"" if k else f"<{DSML}invoke name=\"") + [name, '">\n']
        for j, (key, value) in enumerate(args.items()):
            string = isinstance(value, str)
            out += _template(f"\n<{DSML}parameter name=\"" if j else f"<{DSML}parameter name=\"")
            out += [key, f'" string="{"true" if string else "false"}">', value if string else dumps(value)]
            out += _template(f"</{DSML}parameter>")
        out += _template(f"\n</{DSML}invoke>")
    return out + _template(f"\n</{DSML}tool_calls>")


def tools_block(functions: Sequence[Mapping[str, Any]]) -> list[Piece]:
    """The "## Tools" block for these functions (their JSON schemas as plain text)."""
    return _template(_TOOLS_HEAD) + ["\n".join(dumps(f) for f in functions)] + _template(_TOOLS_TAIL)


def render(messages: Sequence[Mapping[str, Any]], options: ChatOptions = ChatOptions()) -> list[Piece]:
    """The prompt pieces of a conversation (the module docstring has the rules)."""
    functions = check_tools(options.tools)
    choice = check_tool_choice(options.tool_choice, functions)
    level = effort_level(options.reasoning_effort)
    thinking = options.thinking and level != "none"
    turns = _turns(messages)
    extra: list[Piece] = []
    if functions and choice != "none":
        extra += ["\n\n"] + tools_block(functions)
    if options.response_format is not None:
        extra += ["\n\n" + _FORMAT_HEAD, dumps(options.response_format)]
    if extra:
        system = next((t for t in turns if t.role == "system"), None)
        if system is None:
            system = _Turn("system")
            turns.insert(0, system)
        system.extra = extra
    keep = bool(functions) and choice != "none"  # reasoning of earlier turns is kept where tools are rendered
    last_user = max((k for k, t in enumerate(turns) if t.role == "user"), default=-1)
    pieces: list[Piece] = [Special(BOS)] if options.add_bos else []
    if thinking and level in EFFORT_PREAMBLES:
        pieces.append(EFFORT_PREAMBLES[level])
    for k, t in enumerate(turns):
        if t.role == "system":
            pieces += [t.text, *t.extra]
        elif t.role == "user":
            pieces.append(Special(USER))
            for j, (tid, text) in enumerate(t.blocks):
                pieces += (["\n\n"] if j else []) + (["<tool_result>", text, "</tool_result>"] if tid is not None
                                                     else [text])
            if k + 1 == len(turns) or turns[k + 1].role == "assistant":
                think = thinking and (keep or k >= last_user)
                pieces += [Special(ASSISTANT), Special(THINK if think else THINK_END)]
        else:
            if thinking and (keep or k > last_user):
                pieces += [t.reasoning, Special(THINK_END)]
            pieces += [t.text, *(_tool_calls(t.calls) if t.calls else []), Special(EOS)]
    if turns[-1].role != "user":  # a request always asks for the next assistant turn
        pieces += [Special(ASSISTANT), Special(THINK if thinking else THINK_END)]
    return [p for p in pieces if p != ""]


def to_ids(pieces: Sequence[Piece], tokenizer: TokenizerLike) -> list[int]:
    """Token ids of pieces: each run of text encoded as plain text, each special token by id."""
    ids: list[int] = []
    run: list[str] = []
    for p in pieces:
        if isinstance(p, str):
            run.append(p)
            continue
        ids += tokenizer.encode("".join(run)) if run else []
        run = []
        i = tokenizer.token_to_id(p.token)
        if i is None and not p.optional:
            raise EncodingError(f"the tokenizer has no {p.token} token, so no DeepSeek V4 chat template "
                                "(hint: use raw prompt mode)")
        ids += [i] if i is not None else tokenizer.encode(p.token)
    return ids + (tokenizer.encode("".join(run)) if run else [])


def to_text(pieces: Sequence[Piece]) -> str:
    """The prompt as one string (special tokens written out)."""
    return "".join(p if isinstance(p, str) else p.token for p in pieces)


def encode_messages(tokenizer: TokenizerLike, messages: Sequence[Mapping[str, Any]],
                    options: ChatOptions = ChatOptions()) -> list[int]:
    """Prompt ids of a conversation: `to_ids(render(messages, options), tokenizer)`."""
    return to_ids(render(messages, options), tokenizer)
