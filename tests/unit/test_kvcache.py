"""The block manager's bookkeeping (host only): chained hashes, hits only where rings were
saved, shared blocks counted per holder, LRU eviction that drops the hash and the saved
rings with the block, and the pool's accounting."""

from __future__ import annotations

from dsv4.engine.kvcache import BlockManager, chain_hashes
from dsv4.engine.request import Request
from dsv4.engine.sampling import SamplingParams

B = 4


def _req(ids: list[int], rid: str = "r", **sp) -> Request:
    return Request(rid, ids, SamplingParams(**sp))


def test_chain_hashes_name_a_block_by_everything_before_it():
    a = chain_hashes(b"root", list(range(12)), B, [])
    assert len(a) == 3 and len(set(a)) == 3
    b = chain_hashes(b"root", [99] + list(range(1, 12)), B, [])
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 renames every later block
    assert chain_hashes(b"root", list(range(13)), B, a[:1]) == a  # extending known ones
    assert chain_hashes(b"other", list(range(12)), B, []) != a  # the root (model, dtype, ...) counts


def _prefill(kv: BlockManager, req: Request, slot: int) -> None:
    """What the scheduler does for a whole prefill: admit, grow, save at the save point, register."""
    assert kv.admit(req, slot)
    req.slot = slot
    assert kv.grow(slot, kv.blocks_for(req.num_prefill_tokens + 1))
    p = kv.save_point(req)
    if p:
        kv.prefilled(req, req.num_computed_tokens, p - req.num_computed_tokens)
    kv.register(slot, kv.hashes(req), req.num_prefill_tokens)


def test_a_hit_needs_the_chain_and_saved_rings_and_leaves_the_last_token():
    kv = BlockManager(16, B, root="m")
    a = _req(list(range(10)))
    _prefill(kv, a, 0)
    assert a.num_cached_tokens == 0 and kv.save_point(a) == 8
    plan = kv.take_plan()
    held = kv.held[0]
    assert plan.saves == {0: a.block_hashes[1]} and plan.tables[0] == held
    kv.release(0)
    b = _req(list(range(10)) + [50, 51])
    assert kv.admit(b, 1)
    assert b.num_cached_tokens == b.num_computed_tokens == 8 and kv.held[1] == held[:2]  # a's blocks 0, 1
    assert kv.take_plan().loads == {1: a.block_hashes[1]}
    same = _req(list(range(8)))  # two blocks exactly: the hit must leave its last token, and no
    assert kv.lookup(kv.hashes(same), 8) == (0, [])  # rings were saved after block 0
    assert kv.queries == 22 and kv.hits == 8


def test_no_saved_rings_no_hit_and_no_caching_no_hit():
    kv = BlockManager(16, B)
    a = _req(list(range(10)))
    _prefill(kv, a, 0)
    kv.saved.clear()  # as if the rings were dropped
    assert kv.lookup(kv.hashes(_req(list(range(10)))), 10) == (0, [])
    off = BlockManager(16, B, caching=False)
    _prefill(off, _req(list(range(10))), 0)
    assert off.lookup(off.hashes(_req(list(range(10)))), 10) == (0, []) and not off.block_of


def test_shared_blocks_are_counted_per_holder_and_lru_evicted_only_when_idle():
    kv = BlockManager(6, B, max_saved=8)
    a = _req(list(range(10)), "a")
    _prefill(kv, a, 0)  # 3 blocks, blocks 0 and 1 cached
    b = _req(list(range(10)), "b")
    _prefill(kv, b, 1)  # hits 8: shares 2, grows 1
    shared = kv.held[0][:2]
    assert kv.held[1][:2] == shared and all(kv.refs[x] == 2 for x in shared)
    kv.release(0)
    assert all(kv.refs[x] == 1 for x in shared) and kv.available == 6 - 3
    kv.release(1)
    assert kv.available == 6 and list(kv.idle) == shared[::-1]  # cached, held by none: the tail goes first
    kv.take_plan()
    assert kv.grow(2, 5)  # 4 free blocks, then the least recently used cached one: the chain's tail
    plan = kv.take_plan()
    assert shared[1] in kv.held[2] and a.block_hashes[1] not in kv.block_of
    assert plan.drops == [a.block_hashes[1]] and not kv.saved  # its saved rings went with it
    assert a.block_hashes[0] in kv.block_of  # the head stays cached
    assert kv.lookup(kv.hashes(_req(list(range(10)))), 10) == (0, [])  # no rings saved at block 0: a miss
    assert not kv.grow(3, 2)  # 1 left: nothing taken
    assert kv.held.get(3, []) == [] and kv.available == 1


def test_saved_rings_are_kept_up_to_max_saved_lru():
    kv = BlockManager(64, B, max_saved=2)
    reqs = [_req([s] * 9, str(s)) for s in range(3)]
    for i, r in enumerate(reqs):
        _prefill(kv, r, i)
        kv.release(i)
    plan = kv.take_plan()
    assert len(kv.saved) == 2 and plan.drops == [reqs[0].block_hashes[1]]
    assert kv.lookup(kv.hashes(_req([0] * 9)), 9)[0] == 0
    assert kv.lookup(kv.hashes(_req([2] * 9)), 9)[0] == 8


def test_admission_counts_the_whole_prefill_and_prompt_logprobs_skip_the_cache():
    """A request asking for its prompt's logprobs computes its whole prompt (no hit), but saves
    its rings like any other: the sibling samples of its prompt start from them."""
    kv = BlockManager(3, B)
    assert not kv.admit(_req(list(range(12))), 0)  # 13 positions: 4 blocks > 3
    assert kv.available == 3 and kv.queries == 0
    a = _req(list(range(10)))
    _prefill(kv, a, 0)
    kv.release(0)
    lp = _req(list(range(10)), prompt_logprobs=0)
    assert kv.admit(lp, 1) and lp.num_cached_tokens == 0 and kv.save_point(lp) == (10 - 1) // B * B > 0


def test_a_long_prefill_saves_every_save_every_blocks_and_at_its_last_boundary():
    kv = BlockManager(64, B)
    r = _req(list(range(80)))
    every = 8 * B  # SAVE_EVERY blocks
    assert [kv.save_point(r, s) for s in (0, 5, every, 2 * every, 76)] == [every, every, 2 * every, 76, 0]
    r.num_cached_tokens = 2 * every  # a hit: the next save is after it
    assert kv.save_point(r, 2 * every) == 76


def test_a_failed_step_leaves_no_key_without_rings():
    """Rings count once their step succeeded (`register`): a step that failed (its request then
    cancelled) or a request aborted during it leaves the key unsaved and tells the runner to
    forget whatever it stored."""
    kv = BlockManager(16, B)
    a = _req(list(range(10)))
    assert kv.admit(a, 0)
    a.slot = 0
    assert kv.grow(0, 3)
    kv.prefilled(a, 0, 8)
    key = a.block_hashes[1]
    assert kv.take_plan().saves == {0: key} and key not in kv.saved
    kv.release(0)  # the step failed: no register, the request was cancelled
    assert key not in kv.saved and kv.take_plan().drops == [key]
    b = _req(list(range(10)) + [7])
    _prefill(kv, b, 1)  # the same prefix, this time committed
    assert key in kv.saved and kv.take_plan().saves == {1: key}
    c = _req(list(range(10)), "c")
    _prefill(kv, c, 2)  # a hit at 8: nothing to save again
    assert c.num_cached_tokens == 8 and not kv.take_plan().saves


def test_saving_the_same_prefix_twice_keeps_one_and_an_abort_does_not_drop_it():
    kv = BlockManager(16, B)
    a, b = _req(list(range(10)), "a"), _req(list(range(10)), "b")
    for r, slot in ((a, 0), (b, 1)):  # admitted together: neither hits
        assert kv.admit(r, slot)
        r.slot = slot
        assert kv.grow(slot, 3)
        kv.prefilled(r, 0, 8)
    kv.register(0, a.block_hashes, 8)
    kv.take_plan()
    kv.release(1)  # b aborted before its step counted: a's rings stay
    assert a.block_hashes[1] in kv.saved and kv.take_plan().drops == []


def test_the_first_admission_alone_counts_in_the_hit_rate():
    kv = BlockManager(16, B)
    _prefill(kv, _req(list(range(10)), "a"), 0)
    kv.release(0)
    r = _req(list(range(10)) + [1, 2], "r")
    assert kv.admit(r, 1) and r.prompt_cached_tokens == 8
    kv.release(1)  # preempted: admitted again later
    r.num_cached_tokens = 0
    assert kv.admit(r, 1)
    assert (kv.queries, kv.hits) == (10 + 12, 8)
