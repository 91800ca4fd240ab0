"""The grammar that forces a DSML tool call: `tool_choice` "required" or a named function.

`tool_call_ebnf(functions, name)` is a GBNF grammar (translated to Lark for llguidance, `SamplingParams.
structured = {"ebnf": ...}`) whose sentences are exactly the `<｜DSML｜tool_calls>` blocks
DeepSeek V4's encoder writes (`dsv4.agents.encoding._tool_calls`): `\\n\\n<｜DSML｜tool_calls>\\n`,
one or more `invoke`s separated by a single `\\n` (parallel calls), each of a listed function
(or of `name`), its parameters in schema order (required ones always, optional ones maybe),
then `\\n</｜DSML｜tool_calls>`. A parameter whose schema is a string (or an enum of strings)
is `string="true"` with its text (which cannot contain `</`), any other is `string="false"`
with a JSON value of its type (integer, number, boolean, null, else any JSON value). The
model's answer then parses into `tool_calls` with the usual DSML parser; in thinking mode
the engine constrains only after `</think>`.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from dsv4.agents.encoding import DSML

_JSON_RULES = r'''
ws ::= [ \n\t]{0,4}
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ws (json_string ws ":" ws json_value ws ("," ws json_string ws ":" ws json_value ws)*)? "}"
json_array ::= "[" ws (json_value ws ("," ws json_value ws)*)? "]"
json_string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\""
json_int ::= "-"? ("0" | [1-9] [0-9]{0,17})
json_number ::= json_int ("." [0-9]{1,17})? ([eE] [-+]? [0-9]{1,3})?
text ::= ([^<] | "<" [^/])*
'''


def _lit(s: str) -> str:
    """A GBNF string literal (JSON's escapes, which the GBNF reader takes)."""
    return json.dumps(s, ensure_ascii=False)


def _types(schema: Mapping[str, Any]) -> set[str]:
    t = schema.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    if not types and isinstance(schema.get("enum"), list):
        types = {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    return types


def _value(schema: Any) -> tuple[str, str]:
    """(the string attribute, the value's rule) of one parameter."""
    if not isinstance(schema, Mapping):
        return "false", "json_value"
    enum = schema.get("enum")
    types = _types(schema)
    if types == {"string"}:
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "true", "(" + " | ".join(_lit(v) for v in enum) + ")"
        return "true", "text"
    if isinstance(enum, list) and enum:
        return "false", "(" + " | ".join(_lit(json.dumps(v, ensure_ascii=False)) for v in enum) + ")"
    rule = {frozenset({"integer"}): "json_int", frozenset({"number"}): "json_number",
            frozenset({"boolean"}): '("true" | "false")', frozenset({"null"}): '"null"',
            frozenset({"array"}): "json_array", frozenset({"object"}): "json_object"}
    return "false", rule.get(frozenset(types), "json_value")


def _invoke(k: int, fn: Mapping[str, Any]) -> str:
    """The rule `invoke_k` of one function."""
    params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
    props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
    required = set(params.get("required") or [])
    head = _lit(f'<{DSML}invoke name="{fn["name"]}">\n')
    tail = _lit(f"</{DSML}invoke>")
    if not props:  # no schema for the arguments: any parameters, or none
        any_param = (_lit(f'<{DSML}parameter name="') + ' [^"<]+ "\\" string=\\"" ("true\\">" text | '
                     '"false\\">" json_value) ' + _lit(f"</{DSML}parameter>\n"))
        return f"invoke_{k} ::= {head} (({any_param})+ | \"\\n\") {tail}"
    parts = []
    for key, schema in props.items():
        string, rule = _value(schema)
        p = (_lit(f'<{DSML}parameter name="{key}" string="{string}">') + f" {rule} "
             + _lit(f"</{DSML}parameter>\n"))
        parts.append(f"({p})" + ("" if key in required else "?"))
    return f"invoke_{k} ::= {head} " + " ".join(parts) + f" {tail}"


def tool_call_ebnf(functions: Sequence[Mapping[str, Any]], name: str | None = None) -> str:
    """The grammar of a DSML tool-call block calling `functions` (the tools' `function`
    objects), or only the one named `name` (module docstring)."""
    fns = [f for f in functions if name is None or f["name"] == name]
    rules = [_invoke(k, f) for k, f in enumerate(fns)]
    invoke = " | ".join(f"invoke_{k}" for k in range(len(fns)))
    root = (f"root ::= {_lit(chr(10) * 2 + f'<{DSML}tool_calls>' + chr(10))} ({invoke}) "
            f"(\"\\n\" ({invoke}))* {_lit(chr(10) + f'</{DSML}tool_calls>')}")
    return "\n".join([root, *rules]) + _JSON_RULES


def forced_call(functions: Sequence[Mapping[str, Any]], choice: str) -> dict[str, str] | None:
    """The structured-output spec a tool choice forces ("required": a call of any of `functions`,
    a function's name: a call of that one), None for "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    return {"ebnf": tool_call_ebnf(functions, None if choice == "required" else choice)}
