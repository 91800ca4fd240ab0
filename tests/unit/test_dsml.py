"""DSML tool-call parser (dsv4/agents/dsml.py): parse tables, and streaming equal to the
non-streaming parse for every split of the text, with no markup ever reaching content."""
import json
import random
import re

import pytest

from dsv4.agents.dsml import (TRUNCATED, ContentDelta, DSMLStreamParser, ToolCallArgs, ToolCallEnd,
                              ToolCallStart, parse_dsml)

D = "｜DSML｜"


def fn(name, props):
    return {"type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"},
                       "units": {"enum": ["c", "f"]}}),
    fn("search", {"query": {"type": "string"}, "filters": {"type": "object"},
                  "tags": {"type": "array"}, "limit": {"type": ["integer", "null"]}}),
    fn("set_flag", {"on": {"type": "boolean"}, "ratio": {"type": "number"}}),
    fn("wrapped", {"x": {"type": "integer"}}),
    fn("takes_arguments", {"arguments": {"type": "object"}}),
    fn("no_params", {}),
]


def param(name, value, string=True):
    return f'<{D}parameter name="{name}" string="{"true" if string else "false"}">{value}</{D}parameter>'


def invoke(name, *params):
    return f'<{D}invoke name="{name}">\n' + "".join(p + "\n" for p in params) + f"</{D}invoke>"


def block(*invokes, name="tool_calls"):
    return f"\n\n<{D}{name}>\n" + "\n".join(invokes) + f"\n</{D}{name}>"


WEATHER = invoke("get_weather", param("city", "Paris"), param("days", "2", False))

# (text, content, [(name, arguments dict)], finish_reason)
CASES = {
    "plain": ("Hello, world.\n", "Hello, world.\n", [], None),
    "not_a_tag": ("a < b and x<｜y and </div>", "a < b and x<｜y and </div>", [], None),
    "single": (block(WEATHER), "", [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
    "content_before": ("Let me check." + block(WEATHER), "Let me check.",
                       [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
    "parallel": (block(WEATHER, invoke("get_weather", param("city", "Tōkyō 東京"),
                                       param("units", "c"))), "",
                 [("get_weather", {"city": "Paris", "days": 2}),
                  ("get_weather", {"city": "Tōkyō 東京", "units": "c"})], "tool_calls"),
    "nested_json": (block(invoke("search", param("query", 'say "hi"\\n\t<b>x</b> {}'),
                                 param("filters", '{"a": [1, {"b": null}], "c": "é\\u00e9"}', False),
                                 param("tags", '["x", "y"]', False), param("limit", "null", False))),
                    "", [("search", {"query": 'say "hi"\\n\t<b>x</b> {}',
                                     "filters": {"a": [1, {"b": None}], "c": "éé"},
                                     "tags": ["x", "y"], "limit": None})], "tool_calls"),
    "multiline_string": (block(invoke("search", param("query", "line1\nline2\n  </not a tag>\n"))),
                         "", [("search", {"query": "line1\nline2\n  </not a tag>\n"})], "tool_calls"),
    "bool_number": (block(invoke("set_flag", param("on", "true", False), param("ratio", " 0.25 ", False))),
                    "", [("set_flag", {"on": True, "ratio": 0.25})], "tool_calls"),
    # schema decides: integer written as a string, string written as JSON (quoted and bare)
    "schema_decides": (block(invoke("get_weather", param("days", "3"), param("city", '"Rome"', False)),
                             invoke("get_weather", param("city", "Oslo", False), param("units", "7", False))),
                       "", [("get_weather", {"days": 3, "city": "Rome"}),
                            ("get_weather", {"city": "Oslo", "units": "7"})], "tool_calls"),
    "unknown_param": (block(invoke("get_weather", param("city", "Paris"), param("extra", "[1]", False))),
                      "", [("get_weather", {"city": "Paris", "extra": [1]})], "tool_calls"),
    "wrapper": (block(invoke("wrapped", param("arguments", '{"x": 5}', False))), "",
                [("wrapped", {"x": 5})], "tool_calls"),
    "wrapper_is_a_field": (block(invoke("takes_arguments", param("arguments", '{"x": 5}', False))), "",
                           [("takes_arguments", {"arguments": {"x": 5}})], "tool_calls"),
    "no_params": (block(invoke("no_params")), "", [("no_params", {})], "tool_calls"),
    "function_calls": (block(WEATHER, name="function_calls"), "",
                       [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
    "v41_spaces": ("Ok." + f'\n\n<{D} calls>\n<{D} invoke name="get_weather">\n'
                   f'<{D} parameter name="city" string="true">Paris</{D} parameter>\n'
                   f'</{D} invoke>\n</{D} calls>', "Ok.", [("get_weather", {"city": "Paris"})],
                   "tool_calls"),
    "v41_json_body": (block(f'<{D}invoke name="wrapped">\n{{"x": 1}}\n</{D}invoke>'), "",
                      [("wrapped", {"x": 1})], "tool_calls"),
    "bare_invoke": ("Hi " + WEATHER + "\n bye", "Hibye", [("get_weather", {"city": "Paris", "days": 2})],
                    "tool_calls"),
    "block_not_closed": ("x" + block(WEATHER)[:-len(f"</{D}tool_calls>")], "x",
                         [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
    "unknown_function": (block(invoke("rm_rf", param("path", "/")), WEATHER), "",
                         [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
    "only_unknown": ("Sure" + block(invoke("rm_rf", param("path", "/"))), "Sure", [], None),
    "unclosed_call": ("Hm" + block(WEATHER, invoke("get_weather", param("city", "Ber")))[:-40], "Hm",
                      [("get_weather", {"city": "Paris", "days": 2})], "length"),
    "garbage_tag": (f"a<{D}tool_calls oops\nb", "a\nb", [], None),
    "ends_in_tag": (f"abc\n\n<{D}tool_c", "abc", [], "length"),
    "after_block": (block(WEATHER) + "\n\nDone.", "Done.",
                    [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"),
}


def _calls(result):
    return [(c.name, json.loads(c.arguments)) for c in result.calls]


@pytest.mark.parametrize("key", sorted(CASES))
def test_parse_table(key):
    text, content, calls, finish = CASES[key]
    r = parse_dsml(text, TOOLS)
    assert r.content == content
    assert _calls(r) == calls
    assert r.finish_reason == finish
    for c in r.calls:
        assert json.loads(c.arguments) is not None
        if c.error is None:  # the arguments string is json.dumps of the object
            assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)
    for tc in r.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"]) and tc["type"] == "function"
        assert set(tc["function"]) == {"name", "arguments"} and isinstance(tc["function"]["arguments"], str)
    assert len({tc["id"] for tc in r.tool_calls}) == len(r.tool_calls)


def test_exact_arguments_string():
    r = parse_dsml("Checking." + block(WEATHER), TOOLS)
    assert r.tool_calls[0]["function"] == {"name": "get_weather",
                                           "arguments": '{"city": "Paris", "days": 2}'}


def test_malformed_json_is_reported_but_stays_valid_json():
    r = parse_dsml(block(invoke("search", param("filters", "{oops", False))), TOOLS)
    (c,) = r.calls
    assert json.loads(c.arguments) == {"filters": "{oops"}
    assert c.error and "filters" in c.error and r.errors


def test_unknown_function_reported_or_allowed():
    text = block(invoke("rm_rf", param("path", "/")))
    assert any("rm_rf" in e for e in parse_dsml(text, TOOLS).errors)
    assert _calls(parse_dsml(text, None, allow_unknown=True)) == [("rm_rf", {"path": "/"})]
    assert parse_dsml(text, None).calls == []


def test_a_truncated_call_is_not_a_call():
    """Cut inside its invoke, a call may miss what its schema requires: no event of it at all,
    so streamed and whole agree, and finish_reason says length."""
    p = DSMLStreamParser(TOOLS)
    events = p.feed("Sure." + block(invoke("get_weather", param("days", "2", False), param("city", "Ber")))[:-30])
    events += p.finish()
    assert [type(e) for e in events] == [ContentDelta] and events[0].text == "Sure."
    assert p.finish_reason == "length" and p.calls == [] and p.openai_calls() == []


def stream(text, cuts, tools=TOOLS, cut=False):
    """Feed text split at cuts; return (content, [(name, args, error)], events, contents fed)."""
    p = DSMLStreamParser(tools)
    events, pieces, prev = [], [], 0
    for c in list(cuts) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    events += p.finish(cut)
    calls, order = {}, []
    for e in events:
        if isinstance(e, ContentDelta):
            pieces.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(order) and e.index not in calls
            assert re.fullmatch(r"call_[0-9a-f]{24}", e.id)
            calls[e.index] = [e.name, "", None, False]
            order.append(e.index)
        elif isinstance(e, ToolCallArgs):
            assert not calls[e.index][3], "arguments after the end"
            calls[e.index][1] += e.text
        else:
            calls[e.index][2], calls[e.index][3] = e.error, True
    assert all(c[3] for c in calls.values()), "every started call ends"
    return "".join(pieces), [tuple(calls[i][:3]) for i in order], events, pieces


def check_stream(text, cuts, cut=False):
    ref = parse_dsml(text, TOOLS, cut=cut)
    content, calls, _, pieces = stream(text, cuts, cut=cut)
    assert content == ref.content
    assert calls == [(c.name, c.arguments, c.error) for c in ref.calls]
    assert all(c[2] != TRUNCATED for c in calls)
    # '<' or '</' may end a piece once the next character (whitespace, held) decided them
    prefixes = {o[:n] for o in ("<" + D, "</" + D) for n in range(2, len(o) + 1)} - {"</"}
    for piece in pieces:
        assert "DSML" not in piece and not any(piece.endswith(x) for x in prefixes)


FUZZ = [k for k in sorted(CASES) if k not in ("plain",)]


@pytest.mark.parametrize("key", FUZZ)
def test_stream_every_split(key):
    text = CASES[key][0]
    for k in range(len(text) + 1):
        check_stream(text, [k])


@pytest.mark.parametrize("key", FUZZ)
def test_stream_random_splits(key):
    text = CASES[key][0]
    rng = random.Random(key)
    for _ in range(60):
        n = rng.randint(2, 12)
        check_stream(text, sorted(rng.randint(0, len(text)) for _ in range(n)))
    check_stream(text, range(len(text)))  # one character at a time


def test_every_prefix_is_safe():
    """Generation cut anywhere: content never holds markup, calls are a prefix of the full ones."""
    text = "Let me see <b>. " + block(WEATHER, invoke("search", param("query", "a<b"),
                                                     param("tags", '["x"]', False)))
    full = parse_dsml(text, TOOLS)
    for k in range(len(text) + 1):
        r = parse_dsml(text[:k], TOOLS, cut=True)  # stopped by its length
        assert "｜" not in r.content and "DSML" not in r.content
        assert full.content.startswith(r.content.rstrip()) and not r.content.endswith("<")
        assert [(c.name, c.arguments) for c in r.calls] == \
            [(c.name, c.arguments) for c in full.calls[:len(r.calls)]]
        if r.truncated:
            assert r.finish_reason == "length"
        check_stream(text[:k], [k // 2], cut=True)


def test_a_call_streams_whole_when_its_invoke_closes():
    text = block(invoke("get_weather", param("city", "Paris"), param("days", "2", False)))
    close = text.index("</" + D + "invoke>")
    p = DSMLStreamParser(TOOLS)
    before = [e for k in range(close) for e in p.feed(text[k])]
    assert before == []  # nothing of it while it may still be cut
    events = p.feed(text[close:]) + p.finish()
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallArgs", "ToolCallEnd"]
    assert events[0].name == "get_weather" and events[1].text == '{"city": "Paris", "days": 2}'


def test_a_trailing_lt_is_text_and_a_cut_opener_is_not():
    """At the end of a text that ended on purpose, a held-back `<` or `</` that never became
    a tag is content (an answer may end "if a <"); cut by the length limit, it may be a
    block's start and is dropped; the start of DSML markup is never content."""
    for text in ("if a <", "x </", "1 <2"):
        r = parse_dsml(text, TOOLS)
        assert r.content == text and r.finish_reason is None, r
        check_stream(text, range(len(text)))
    assert parse_dsml("if a <", TOOLS, cut=True).content == "if a"
    r = parse_dsml("x <｜DS", TOOLS)
    assert r.content == "x" and r.finish_reason == "length"


def test_a_call_cut_by_the_end_after_a_complete_one_keeps_only_the_complete_one():
    text = "Sure." + block(WEATHER, invoke("get_weather", param("city", "Berlin"), param("days", "2", False)))
    cut = text[:text.index("Berlin") + 3]
    p = DSMLStreamParser(TOOLS)
    events = p.feed(cut) + p.finish()
    assert len(p.calls) == 1 and p.finish_reason == "length"
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0]
