"""Structured-output fields of an OpenAI (or vLLM) request body -> `SamplingParams.structured`.

Read, at most one of them per request:

* OpenAI's `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`
  (the schema is always enforced; `strict` is accepted either way);
* vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`; its
  whitespace and backend options are ignored) and its older `guided_*` extras.

The result is a map `{kind: value}` (`dsv4.engine.grammar.masks.KINDS`): the daemon compiles it,
and answers a grammar that does not compile, a schema over 64 KiB or a server without
llguidance with a 400. Shapes wrong here are a 400 `ApiError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4.http.errors import bad as _error
from dsv4.http.errors import short as _short

# vLLM's key -> dsv4's kind
_VLLM = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
         "grammar": "ebnf"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "ebnf"}
FIELDS = ("response_format", "structured_outputs", *_GUIDED)  # the body fields this module reads


def _schema(value: Any, field: str) -> Any:
    """A JSON schema given as an object (or true/false) or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _error(f"{field}: the schema is not valid JSON ({e})", field.split(".")[0]) from None
    if not isinstance(value, (dict, bool)):
        raise _error(f"{field} must be a JSON schema (an object), got {_short(value)}", field.split(".")[0])
    return value


def _value(kind: str, value: Any, field: str) -> Any:
    if kind == "json_schema":
        return _schema(value, field)
    if kind == "json_object":
        if value is not True:
            raise _error(f"{field} must be true, got {_short(value)}", field.split(".")[0])
        return True
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _error(f"{field} must be a non-empty list of non-empty strings, got {_short(value)}",
                             field.split(".")[0])
        return list(value)
    if not isinstance(value, str) or not value:
        raise _error(f"{field} must be a non-empty string, got {_short(value)}", field.split(".")[0])
    return value


def _response_format(rf: Any) -> dict[str, Any] | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _error(f'response_format must be an object with a type (text, json_object or json_schema), '
                         f'got {_short(rf)}', "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or js.get("schema") is None:
            raise _error("response_format json_schema needs json_schema.schema (the JSON schema)",
                             "response_format")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise _error(f"response_format json_schema.strict must be true or false, got "
                             f"{_short(js['strict'])}", "response_format")
        return {"json_schema": _schema(js["schema"], "response_format.json_schema.schema")}
    raise _error(f"response_format type {_short(kind)} is not supported (text, json_object or json_schema)",
                     "response_format")


def _structured_outputs(so: Any) -> dict[str, Any]:
    if not isinstance(so, dict):
        raise _error(f"structured_outputs must be an object, got {_short(so)}", "structured_outputs")
    given = [k for k in _VLLM if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _error(f"structured_outputs needs exactly one of {', '.join(_VLLM)}, got "
                         f"{', '.join(given) or 'none'}", "structured_outputs")
    kind = _VLLM[given[0]]
    return {kind: _value(kind, so[given[0]], f"structured_outputs.{given[0]}")}


def structured_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint a body asks for (module docstring), or None for free text."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: _value(kind, body[name], name)}))
    if len(found) > 1:
        raise _error(f"send one structured-output field, got {', '.join(n for n, _ in found)}", found[1][0])
    return found[0][1] if found else None
