"""StopChecker: stop strings across token boundaries, held-back text, flush."""

from __future__ import annotations

import random

import pytest

from dsv4.engine.stop import StopChecker


def run(stop, pieces, include=False):
    sc = StopChecker(stop, include)
    out, stopped = [], False
    for p in pieces:
        text, stopped = sc.feed(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(sc.flush())
    return "".join(out), stopped, out


def test_no_stop_strings_pass_through() -> None:
    sc = StopChecker([])
    assert sc.feed("abc") == ("abc", False) and sc.flush() == ""


def test_stop_within_one_piece() -> None:
    assert run(["END"], ["hello END world"])[:2] == ("hello ", True)


def test_stop_across_pieces_is_held_then_dropped() -> None:
    text, stopped, parts = run(["END"], ["hello E", "N", "D and more"])
    assert (text, stopped) == ("hello ", True)
    assert parts == ["hello ", "", ""]  # "E" and "EN" were held back, never emitted


def test_false_alarm_released() -> None:
    sc = StopChecker(["END"])
    assert sc.feed("an E") == ("an ", False)
    assert sc.feed("N") == ("", False)
    assert sc.feed("x") == ("ENx", False)
    assert sc.feed("E") == ("", False)
    assert sc.flush() == "E"


def test_earliest_of_several_stops() -> None:
    assert run(["world", "lo w"], ["hello world"])[:2] == ("hel", True)
    sc = StopChecker(["abc", "b"])
    assert sc.feed("xab") == ("xa", True) and sc.matched == "b"


def test_overlapping_prefixes() -> None:
    # "aab" contains "ab": holding only a 1-char prefix would lose the match
    assert run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    assert run(["abab"], ["ab", "ab", "ab"])[:2] == ("", True)


def test_after_stop_nothing_more() -> None:
    sc = StopChecker(["x"])
    assert sc.feed("ax") == ("a", True)
    assert sc.feed("more") == ("", True) and sc.flush() == ""


def test_unicode() -> None:
    assert run(["。\n"], ["你好", "。", "\n再见"])[:2] == ("你好", True)


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_match_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got, stopped, _ = run(stops, pieces)
    assert (got, stopped) == (expected, bool(hits))


def test_include_keeps_the_stop_string_and_drops_what_follows() -> None:
    """vLLM's include_stop_str_in_output: the matched string ends the text, across pieces too."""
    assert run(["END"], ["hello END world"], include=True)[:2] == ("hello END", True)
    assert run(["END"], ["hello E", "N", "D and more"], include=True)[:2] == ("hello END", True)
    assert run(["world", "lo w"], ["hello world"], include=True)[:2] == ("hello w", True)  # the earliest
