"""Paged state and the prefix cache against a cold prefill: a request resuming from shared
blocks and saved rings computes what it would have computed alone (model level, any block
boundary, inside and past the window, after rollback), and the engine's hits, preemptions
and evictions leave every output as it is without them (greedy and seeded, MTP K 0..3)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.model.state import Batch
from tests.model.conftest import bound, prefill

pytestmark = pytest.mark.exact  # also run under other CPU kernels (test.sh)

V, B = 128, 8  # tiny vocabulary; blocks of 8 positions (ratios 4 and 8; window 12)


def _ids(n: int, seed: int = 0, vocab: int = V) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(model, state, slot: int, start: int, toks: list[int]) -> torch.Tensor:
    """One dispatch of `toks` from `start` on `slot` -> logits [n, V]."""
    _, lg = model.forward_batch(Batch.build([(slot, start, toks)]), state)
    return lg


@pytest.mark.parametrize("hit,n", [(8, 9), (8, 30), (16, 17), (16, 45), (24, 60), (40, 41), (40, 77)])
def test_saved_rings_and_shared_blocks_resume_exactly(tiny_model, hit, n):
    """Slot 0 prefills ids[:hit] (irregular chunks), saves its rings and prefills the rest;
    slot 1, its rings full of garbage, takes slot 0's first hit/B blocks and the saved rings
    and prefills only ids[hit:]. Both equal the whole forward, the shared blocks are never
    written, and decoding on (with rollback of drafts) stays equal."""
    ids = _ids(n + 4, seed=hit * 1000 + n)
    prompt, more = ids[:n], ids[n:]
    whole = tiny_model(torch.tensor([ids]))[0]
    tol = bound(tiny_model, ids)
    st = tiny_model.new_state(2, 96, max_chunk=64, num_blocks=40, block_size=B)
    st.assign(0, list(range(12)))
    plan = [c for c in (5, 1, 7, 3, 20, 9, 13) if c] + [64]
    cut, left = [], hit
    for c in plan:  # an irregular chunking of ids[:hit]
        if left:
            cut.append(min(c, left))
            left -= cut[-1]
    _, cold_head = prefill(tiny_model, st, 0, prompt[:hit], cut)
    saved = st.save_rings(0)
    cold_tail = _decode(tiny_model, st, 0, hit, prompt[hit:])
    for ls in st.layers + [st.mtp]:  # slot 1 starts from garbage, as a reused slot does
        for name in ("win", "raw_kv", "raw_score", "idx_raw_kv", "idx_raw_score"):
            if hasattr(ls, name):
                getattr(ls, name)[1].normal_()
    shared = st.blocks[0][: hit // B]
    st.assign(1, shared + list(range(12, 24))[: 12 - len(shared)])
    pools = [getattr(ls, k) for ls in st.layers for k in ("entries", "idx_entries") if hasattr(ls, k)]
    before = [t[shared].clone() for t in pools]
    st.load_rings(1, saved)
    assert st.lengths[1] == hit
    warm_tail = _decode(tiny_model, st, 1, hit, prompt[hit:])
    after = [t[shared] for t in pools]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a shared block was written"
    assert (cold_head - whole[:hit]).abs().max().item() <= tol
    assert (cold_tail - whole[hit:n]).abs().max().item() <= tol
    assert (warm_tail - whole[hit:n]).abs().max().item() <= tol
    # decode on: drafts written then rolled back leave no trace in either slot
    for slot in (0, 1):
        _decode(tiny_model, st, slot, n, [more[0], 5, 6, 7])
        st.rollback(slot, n + 1)
        lg = _decode(tiny_model, st, slot, n + 1, more[1:])
        assert (lg - whole[n + 1:]).abs().max().item() <= tol, slot
    other = st.snapshot(1)
    for k, v in st.snapshot(0).items():
        assert v.shape == other[k].shape and (v.numel() == 0 or (v - other[k]).abs().max().item() <= tol), k


def test_a_dispatch_past_its_blocks_is_refused(tiny_model):
    st = tiny_model.new_state(1, 64, max_chunk=32, num_blocks=4, block_size=B)
    st.assign(0, [2])
    tiny_model.forward_batch(Batch.build([(0, 0, _ids(8))]), st)
    with pytest.raises(ValueError, match="has no block"):
        tiny_model.forward_batch(Batch.build([(0, 8, _ids(1))]), st)


# ---------------------------------------------------------------------- the engine
GEN = 12


def _llm(ckpt, K: int, **kw) -> LLM:
    kw.setdefault("max_model_len", 1024)
    return LLM(ckpt, num_speculative_tokens=K, max_num_seqs=4, prefill_limit=64, **kw)


def _texts(llm: LLM, prompts, **sp) -> list[list[int]]:
    sp.setdefault("max_tokens", GEN)
    return [c.token_ids for c in llm.generate(prompts, SamplingParams(ignore_eos=True, **sp))]


def _rounds(seed: int = 7) -> list[list[list[int]]]:
    """Rounds of prompts (each round after the previous one finished): a 600-token base
    whose prefixes end inside a block, one past a boundary, at a boundary, and beyond."""
    base = _ids(900, seed=seed, vocab=4096)
    tail = _ids(40, seed=seed + 1, vocab=4096)
    return [[base[:300]], [base[:257], base[:512], base[:600] + tail], [base[:513], base[:520] + tail],
            [base[:300]], [base[:900]]]


@pytest.mark.parametrize("K", [0, 1, 2, 3])
def test_hits_give_what_a_cold_prefill_gives(tiny_checkpoint, K):
    cold = _llm(tiny_checkpoint, K, enable_prefix_caching=False)
    warm = _llm(tiny_checkpoint, K)
    for prompts in _rounds():
        assert _texts(warm, prompts) == _texts(cold, prompts), prompts
    kv = warm.engine.scheduler.kv
    assert kv.hits >= 256 * 7, kv.stats()  # every round after the first hits
    assert cold.engine.scheduler.kv.hits == 0
    if K:  # the drafter resumed from the saved rings: it drafts what it drafted cold
        a, b = (llm.engine.metrics.to_dict()["spec"] for llm in (warm, cold))
        assert (a["drafted"], a["accepted"]) == (b["drafted"], b["accepted"])


@pytest.mark.parametrize("K", [0, 2])
@pytest.mark.parametrize("seeded", [False, True])
def test_preempted_requests_recompute_to_the_same_output(tiny_checkpoint, K, seeded):
    """A pool of 4 blocks for 4 requests of 250-token prompts: each crosses into its second
    block while decoding, so the newest are preempted and recomputed (from the prefix cache
    where it still holds their prompt)."""
    prompts = [_ids(250, seed=s, vocab=4096) for s in range(4)]
    sp = dict(max_tokens=30, temperature=0.9, seed=11) if seeded else dict(max_tokens=30)
    ref = _texts(_llm(tiny_checkpoint, K, max_model_len=512, enable_prefix_caching=False), prompts, **sp)
    small = _llm(tiny_checkpoint, K, max_model_len=512)
    per_block = small.engine.config.kv_cache_memory // small.engine.config.kv_cache_blocks
    small = _llm(tiny_checkpoint, K, max_model_len=512, kv_cache_memory=4 * per_block)
    assert small.engine.config.kv_cache_blocks == 4
    assert _texts(small, prompts, **sp) == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.kv.available == 4  # every block back


def test_eviction_makes_a_miss_never_a_stale_hit(tiny_checkpoint):
    """A pool of 5 blocks: each new 520-token prompt evicts the cached blocks of older ones;
    asking again for an evicted prompt (or one whose first block went, or whose saved rings
    went) recomputes it and gives the cold output."""
    prompts = [_ids(520, seed=100 + s, vocab=4096) for s in range(4)]
    cold = _llm(tiny_checkpoint, 1, enable_prefix_caching=False, max_model_len=600)
    probe = _llm(tiny_checkpoint, 1, max_model_len=600)
    per_block = probe.engine.config.kv_cache_memory // probe.engine.config.kv_cache_blocks
    warm = _llm(tiny_checkpoint, 1, max_model_len=600, kv_cache_memory=5 * per_block)
    order = [0, 1, 0, 2, 3, 1, 0, 3, 2, 0]
    for i in order:
        assert _texts(warm, [prompts[i]]) == _texts(cold, [prompts[i]]), i
    kv = warm.engine.scheduler.kv
    assert 0 < kv.hits < kv.queries and kv.available == 5
    assert len(kv.block_of) <= 5 and set(kv.saved) <= set(kv.block_of)
    assert set(warm.engine.runner.saved.by_key) == set(kv.saved)  # what the runner holds is what the cache names


def test_two_ranks_agree_on_every_hit(tiny_checkpoint):
    """--tensor-parallel-size 2: each rank keeps its own saved rings and applies rank 0's
    KV plan, so hits (and the drafts after them) give the single process's cold tokens."""
    threads = torch.get_num_threads()
    rounds = _rounds()[:3]
    try:
        cold = _llm(tiny_checkpoint, 2, enable_prefix_caching=False)
        ref = [_texts(cold, prompts) for prompts in rounds]
        with _llm(tiny_checkpoint, 2, tensor_parallel_size=2) as warm:
            assert [_texts(warm, prompts) for prompts in rounds] == ref
            assert warm.engine.scheduler.kv.hits >= 256 * 3
    finally:
        torch.set_num_threads(threads)
