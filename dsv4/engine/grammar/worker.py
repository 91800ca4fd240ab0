"""One grammar-compile worker process: a structured-output spec in, a checked llguidance grammar
out (`grammar_compile.CompilePool` starts, feeds and kills it).

    python -m dsv4.engine.grammar.worker FD      # FD: its end of a socketpair

Messages (pickled by `multiprocessing.connection`): first the vocabulary (answered "ready"
once its tokenizer is built); then ("compile", spec, light_only) -> ("ok", grammar),
("err", one line), or ("heavy", None) when `light_only` and the grammar is not light
(`is_light`). "Compiling" is: the spec translated (`to_grammar`), validated against the
vocabulary, and a matcher built and asked for its first mask, so every cost of the grammar
is paid here, within the pool's time budget, and a grammar llguidance refuses (or that hits
its parser limits) is a one-line error. The process exits when its parent's end closes.
Details: docs/serving.md, 'dsv4/engine/grammar/worker.py'.
"""

from __future__ import annotations

import json
import sys
from typing import Any

LIGHT_BYTES = 8 << 10  # of the llguidance grammar: a "light" one belongs in the small lane
MAX_JSON_WHITESPACE = 16  # each run of whitespace in JSON: a model cannot pad forever
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def strict(schema: Any) -> Any:
    """A copy of a JSON schema in which every object that lists `properties` and says nothing
    of others allows no others (`additionalProperties: false`): what a caller of an API with a
    schema means (xgrammar's strict mode, OpenAI's strict schemas), and a bound on what a model
    can write into a key it invents."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    for k in _SUBSCHEMA:
        if k in out:
            out[k] = strict(out[k])
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict(v) for name, v in out[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [strict(v) for v in out[k]]
    return out


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly `choices` (JSON string escapes)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_grammar(spec: dict[str, Any]) -> str:
    """The llguidance grammar (its JSON form) of a checked spec: no vocabulary work. `ebnf`
    takes GBNF (`root ::= ...`, as vLLM's guided_grammar and the forced tool calls write it)
    or Lark. ValueError with one line when it cannot be translated."""
    import llguidance as llg
    from llguidance.gbnf_to_lark import any_to_lark

    (kind, value), = spec.items()
    try:
        if kind == "json_object":  # any object
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            return llg.LLMatcher.grammar_from_json_schema(strict(schema), overrides=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark(choice_lark(value))
        return llg.LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as e:  # noqa: BLE001  (llguidance raises ValueError, the GBNF reader its own)
        raise ValueError(f"structured {kind}: cannot compile: {_line(e)}") from None


def _line(e: BaseException | str) -> str:
    msg = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException) else "")
    return msg[:300]


def is_light(grammar: str) -> bool:
    """Whether a translated grammar belongs in the small lane (short)."""
    return len(grammar) <= LIGHT_BYTES


def tokenizer(vocab: dict[str, Any]) -> Any:
    """llguidance's tokenizer of `Grammars._tokenizer_info`'s message, ready for masks (seconds
    for V4's 129k ids, most of it the token trie its first matcher builds: docs/serving.md,
    'dsv4/engine/grammar/masks.py')."""
    import llguidance as llg

    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(vocab["tokenizer_json"])

    class _Vocab:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id = vocab["eos"], None
        tokens, special_token_ids = vocab["tokens"], vocab["special"]

        def __call__(self, s: Any) -> list[int]:  # the canonical ids of text the grammar forces
            text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
            return hf.encode(text, add_special_tokens=False).ids

    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=len(vocab["tokens"]), eos_token=vocab["eos"])
    check(tok, llg.LLMatcher.grammar_from_regex("[a-z]+"), "warm-up")  # the first matcher builds the token trie (~3 s)
    return tok


def check(tok: Any, grammar: str, what: str) -> None:
    """Validate `grammar` against the vocabulary and build its first mask; ValueError (one line)."""
    import llguidance as llg
    import llguidance.numpy as lln  # not llguidance.torch: importing torch would cost each worker start ~4 CPU-s

    err = llg.LLMatcher.validate_grammar(grammar, tok)
    if err:
        raise ValueError(f"structured {what}: cannot compile: {_line(err)}")
    m = llg.LLMatcher(tok, grammar, log_level=0)
    lln.fill_next_token_bitmask(m, lln.allocate_token_bitmask(1, tok.vocab_size), 0)
    if m.is_error():
        raise ValueError(f"structured {what}: cannot compile: {_line(m.get_error())}")


def compile_spec(tok: Any, spec: dict[str, Any], light_only: bool = False) -> str | None:
    """The checked grammar of a spec; ValueError (one line). `light_only`: None, without
    building it, when the grammar is not light (`is_light`)."""
    grammar = to_grammar(spec)
    if light_only and not is_light(grammar):
        return None
    check(tok, grammar, next(iter(spec)))
    return grammar


def main(fd: int) -> None:
    import socket
    from multiprocessing.connection import Connection

    _die_with_parent()
    conn = Connection(socket.socket(fileno=fd).detach())
    try:
        tok = tokenizer(conn.recv())
        conn.send("ready")
        while True:
            op, spec, light_only = conn.recv()
            if op != "compile":
                return
            try:
                grammar = compile_spec(tok, spec, light_only)
                conn.send(("heavy", None) if grammar is None else ("ok", grammar))
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
