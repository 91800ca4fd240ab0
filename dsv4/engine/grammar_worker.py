"""One grammar-compile worker process: a structured-output spec in, xgrammar's serialised
`CompiledGrammar` out (`grammar_compile.CompilePool` starts, feeds and kills it).

    python -m dsv4.engine.grammar_worker FD      # FD: its end of a socketpair

Messages (pickled by `multiprocessing.connection`): first the vocabulary as xgrammar's
serialised `TokenizerInfo` (answered "ready"); then ("compile", spec, light_only) -> ("ok", json),
("err", one line), or ("heavy", None) when `light_only` and the grammar is not light (`is_light`:
the small lane sends it on to the large lane without compiling).
A spec is refused before any vocabulary work when its expanded grammar has more than
MAX_CHAR_CLASSES character classes (their cost grows with the vocabulary: 1,500 negated
classes compiled for over 120 s against V4's); the time budget is the pool's (it kills the
process). The process exits when its parent's end closes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MAX_CHAR_CLASSES = 512  # `[...]` classes of the expanded grammar (a 60-field schema has ~50)
# A grammar "light" enough for the small lane (`grammar_compile`): its cost is small whatever the vocabulary
LIGHT_CLASSES = 32
LIGHT_CHARS = 8 << 10  # of the expanded grammar's text
MAX_JSON_WHITESPACE = 16  # each run of whitespace in JSON: a model cannot pad forever
_WHITESPACE = {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse(spec: dict[str, Any]) -> Any:
    """The xgrammar `Grammar` of a checked spec (cheap: no vocabulary work); ValueError with
    one line when it does not parse or is over the character-class budget."""
    import xgrammar as xgr

    (kind, value), = spec.items()
    try:
        if kind == "json_object":  # an object (xgrammar's builtin JSON grammar takes any value)
            g = xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_WHITESPACE)
        elif kind == "json_schema":
            schema = value if isinstance(value, str) else json.dumps(value)
            g = xgr.Grammar.from_json_schema(schema, strict_mode=True, **_WHITESPACE)
        elif kind == "regex":
            g = xgr.Grammar.from_regex(value)
        elif kind == "choice":
            g = xgr.Grammar.from_ebnf(choice_ebnf(value))
        else:
            g = xgr.Grammar.from_ebnf(value)
    except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError/ValueError/its own types)
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"structured {kind}: cannot compile: {msg[:300]}") from None
    classes = str(g).count("[")
    if classes > MAX_CHAR_CLASSES:
        raise ValueError(f"structured {kind}: the grammar has {classes} character classes, over the limit of "
                         f"{MAX_CHAR_CLASSES}; send a simpler grammar")
    return g


def is_light(grammar: Any) -> bool:
    """Whether a parsed grammar belongs in the small lane (few character classes, short)."""
    text = str(grammar)
    return text.count("[") <= LIGHT_CLASSES and len(text) <= LIGHT_CHARS


def compile_spec(compiler: Any, spec: dict[str, Any], light_only: bool = False) -> Any:
    """`compiler` (an xgrammar GrammarCompiler) applied to a checked spec; ValueError (one line).
    `light_only`: None, without compiling, when the grammar is not light (`is_light`)."""
    grammar = parse(spec)
    if light_only and not is_light(grammar):
        return None
    try:
        return compiler.compile_grammar(grammar)
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"structured {next(iter(spec))}: cannot compile: {msg[:300]}") from None


def main(fd: int) -> None:
    import socket
    from multiprocessing.connection import Connection

    import xgrammar as xgr

    _die_with_parent()
    conn = Connection(socket.socket(fileno=fd).detach())
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        conn.send("ready")
        while True:
            op, spec, light_only = conn.recv()
            if op != "compile":
                return
            try:
                compiled = compile_spec(compiler, spec, light_only)
                conn.send(("heavy", None) if compiled is None else ("ok", compiled.serialize_json()))
            except ValueError as e:
                conn.send(("err", str(e)))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the daemon went away (or killed us)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the daemon dies, even in the middle of a compile."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: it exits at its next read, once the compile in progress ends


if __name__ == "__main__":
    main(int(sys.argv[1]))
