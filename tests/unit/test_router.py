"""The replicas' router (dsv4/engine/replicas/router.py): a prompt goes where the longest
prefix of it was sent, unless that replica is too far ahead of the least loaded; a salt keeps
tenants apart; a replica not serving gets nothing; what a replica is thought to hold is bounded
by its pool; the baselines ("load", "random") ignore prefixes."""

from __future__ import annotations

import pytest

from dsv4.engine.replicas.cores import cpulist as _cpulist, cores_of
from dsv4.engine.replicas.router import PIECE_TOKENS, Router

P = PIECE_TOKENS


def prompt(seed: int, pieces: int) -> list[int]:
    return [(seed * 1000 + i) % 50000 for i in range(pieces * P)]


def test_the_longest_held_prefix_wins_and_a_conversation_stays() -> None:
    r = Router(2, [10_000, 10_000], b"root", slack=8)
    a, b = prompt(1, 4), prompt(2, 4)
    assert r.route(a, None, [0, 0])[:2] == (0, "load")
    assert r.route(b, None, [1, 0])[:2] == (1, "load")  # the least loaded
    # the next turn of each conversation: its first prompt plus more
    assert r.route(a + prompt(3, 2), None, [1, 1]) == (0, "prefix", 4)
    assert r.route(b + prompt(4, 1), None, [2, 1]) == (1, "prefix", 4)
    # a prompt sharing 2 pieces with a's goes to a's replica though it is busier
    assert r.route(a[:2 * P] + prompt(5, 3), None, [3, 2]) == (0, "prefix", 2)
    assert r.decisions == {"prefix": 3, "load": 2, "balance": 0}
    assert r.per_replica[0]["prefix"] == 2 and r.per_replica[1]["load"] == 1


def test_a_salt_keeps_tenants_apart() -> None:
    r = Router(2, [10_000, 10_000], b"root", slack=8)
    a = prompt(1, 4)
    assert r.route(a, "tenant-1", [0, 0])[0] == 0
    assert r.route(a, "tenant-2", [1, 0])[:2] == (1, "load")  # the same tokens under another salt: no match
    assert r.route(a, "tenant-1", [1, 1])[:2] == (0, "prefix")
    assert r.route(a, None, [2, 1])[:2] == (1, "load")


def test_an_overloaded_holder_gives_way_and_dead_replicas_get_nothing() -> None:
    r = Router(3, [10_000] * 3, b"root", slack=2)
    a = prompt(1, 4)
    assert r.route(a, None, [0, 0, 0])[0] == 0
    assert r.route(a, None, [3, 0, 1])[:2] == (1, "balance")  # 3 ahead of the least loaded: over the slack
    assert r.route(a, None, [2, None, 0])[:2] == (0, "prefix")  # 2 ahead: within it
    assert r.route(prompt(9, 1), None, [None, None, 5])[0] == 2
    with pytest.raises(LookupError):
        r.route(a, None, [None, None, None])


def test_what_a_replica_holds_is_bounded_and_forgotten_on_restart() -> None:
    r = Router(2, [4, 4], b"root", slack=100)
    a, b = prompt(1, 4), prompt(2, 4)
    r.route(a, None, [0, 0])
    r.route(b, None, [0, 1])  # replica 0 again (least loaded): its 4 pieces push a's out
    assert r.matched(0, r.hashes(a, None)) == 0 and r.matched(0, r.hashes(b, None)) == 4
    r.forget(0)
    assert r.matched(0, r.hashes(b, None)) == 0


def test_ties_go_round_and_the_baselines_ignore_prefixes() -> None:
    r = Router(2, [10_000] * 2, b"root", slack=8)
    assert [r.route(prompt(i, 1), None, [0, 0])[0] for i in range(4)] == [0, 1, 0, 1]
    load = Router(2, [10_000] * 2, b"root", slack=8, mode="load")
    a = prompt(1, 4)
    load.route(a, None, [0, 0])
    assert load.route(a, None, [1, 0])[:2] == (1, "load")
    rnd = Router(2, [10_000] * 2, b"root", slack=8, mode="random")
    assert {rnd.route(a, None, [0, 0])[0] for _ in range(40)} == {0, 1}
    with pytest.raises(ValueError, match="routing mode 'fastest'"):
        Router(2, [1, 1], b"root", slack=1, mode="fastest")


def test_cores_split_into_disjoint_groups() -> None:
    assert _cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    groups = cores_of(1)
    assert len(groups) == 1 and groups[0]
    if len(groups[0]) >= 2:
        two = cores_of(2)
        assert len(two) == 2 and all(two) and not set(two[0]) & set(two[1])
