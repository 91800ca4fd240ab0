"""Tensor and expert parallelism on gloo (CPU, fp32): T = 2 ranks, each loading only its
slices of a tiny checkpoint, give the single-process model's logits (to 1e-5: the
all_reduces reorder sums) for the stateless forward, a chunked prefill + decode through
the slot state, and the MTP block; w8a8 too (a row-parallel int8 slice is quantised with its whole rows'
scales, so only the order of the float32 sums differs there as well); T = 4 on the
variant of the tiny config whose split dimensions divide by 4 (`tiny.TP4`)."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dsv4.model import parallel, sharding
from dsv4.model.loader import load_model
from dsv4.model.state import Batch
from tests.e2e.util import free_port
from tests.checkpoints import write_tiny_checkpoint
from tests.model.conftest import W8A8_DENSE

WORLD = 2
TIMEOUT_S = 240



def run_model(model) -> dict[str, torch.Tensor]:
    """What every layout must reproduce: stateless logits, chunked prefill + decode logits
    of two slots in one state, and the MTP logits over the prefilled pairs."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, model.cfg.vocab_size, (2, 40), generator=g)
    out = {"whole": model(ids)}
    state = model.new_state(2, 64, max_chunk=16, max_spec=2)
    chunks, hs = [], []
    with torch.inference_mode():
        for slot in (0, 1):
            start = 0
            for n in (16, 9, 15):  # crosses compressor windows and the 12-token sliding window
                h, lg = model.forward_batch(Batch.build([(slot, start, ids[slot, start:start + n].tolist())]), state)
                chunks.append(lg)
                hs.append(h)
                start += n
        for step in range(6):  # both slots decode together
            toks = [int(ids[s, step]) for s in (0, 1)]
            _, lg = model.forward_batch(Batch.build([(s, 40 + step, [toks[s]]) for s in (0, 1)]), state)
            chunks.append(lg)
        nxt, h0, mlg, start = ids[0, 1:].tolist() + [3], torch.cat(hs[:3]), [], 0
        for n in (16, 9, 15):  # the MTP over slot 0's pairs (h_t, x_{t+1}), chunk by chunk
            _, lg = model.mtp_forward(Batch.build([(0, start, nxt[start:start + n])]), h0[start:start + n], state)
            mlg.append(lg)
            start += n
    out["stateful"] = torch.cat(chunks)
    out["mtp"] = torch.cat(mlg)
    return out


def _rank_entry(rank: int, world: int, port: int, out: str, work: Callable[..., Any], args: tuple,
                timeout_s: float = 120) -> None:
    """One spawned rank: join the gloo group (collective timeout `timeout_s`), save
    `work(rank, world, *args)` to out.<rank>."""
    try:
        torch.set_num_threads(1)
        parallel.init(rank, world, "127.0.0.1", port, timeout_s=timeout_s)
        torch.save(work(rank, world, *args), f"{out}.{rank}")
        torch.distributed.barrier()  # rank 0 serves the store: it leaves the group last
        parallel.close()
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)


def spawn_ranks(work: Callable[..., Any], args: tuple, tmp: Path, world: int = WORLD,
                timeout_s: float = 120) -> tuple[list[Any], list[int]]:
    """Run `work(rank, world, *args)` (a module-level function) on `world` spawned ranks of one
    gloo group (collective timeout `timeout_s`); (every rank's result, the ranks' pids).
    Every rank must exit 0."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, str(tmp / "out"), work, args, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(tmp / f"out.{r}") for r in range(world)], [p.pid for p in procs]


def _model_work(rank: int, world: int, variants: list[tuple[str, str]]) -> dict[str, dict[str, torch.Tensor]]:
    """`run_model` on this rank's slices of each (checkpoint, quantization), one group for all."""
    results = {}
    for ckpt, quant in variants:
        model = load_model(ckpt, quantization=quant, rank=rank, world=world)
        res = run_model(model)
        res["weight_bytes"] = torch.tensor(sum(t.numel() * t.element_size() for t in model.state_dict().values()))
        results[f"{ckpt}:{quant}"] = res
    return results


def run_parallel(variants: list[tuple[Path, str]], tmp: Path, world: int = WORLD) -> list[dict[str, dict]]:
    """Run `run_model` for every (checkpoint, quantization) on one group of `world` spawned
    ranks (a group costs seconds of start-up); every rank's results by "ckpt:quant"."""
    return spawn_ranks(_model_work, ([(str(c), q) for c, q in variants],), tmp, world)[0]


VARIANTS = ["none", "w8a8", "converted"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, tuple[Path, str, list[dict]]]:
    """FP8 linears (128x128 block scales cut through by the T = 2 slices), FP4 experts and a BF16
    head (kept so by the int8 modes, each rank holding its vocabulary rows), loaded
    as stored (none), converted at load (w8a8), and from a `dsv4 convert` output (converted:
    int8 rows + row scales on disk, sliced as stored); all three on one group of 2 ranks."""
    from dsv4.model.convert import convert_checkpoint

    tmp = tmp_path_factory.mktemp("tp")
    fp8 = tmp / "ck"
    write_tiny_checkpoint(fp8, quantize=True, num_shards=2, with_tokenizer=False, vocab_size=256, head_bf16=True,
                          **W8A8_DENSE)
    convert_checkpoint(fp8, tmp / "w8a8")
    variants = {"none": (fp8, "none"), "w8a8": (fp8, "w8a8"), "converted": (tmp / "w8a8", "w8a8")}
    outs = run_parallel(list(variants.values()), tmp)
    return {k: (c, q, [o[f"{c}:{q}"] for o in outs]) for k, (c, q) in variants.items()}


@pytest.mark.exact
@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_equal_one(two_ranks, variant: str):
    """float32: to 1e-5 (the all_reduces reorder sums). w8a8: within the model's quantisation
    error (max |w8a8 - float32| of the single process, per output; tests/model/conftest.py
    `bound`): a reordered float32 sum can flip a token's int8 rounding, as a batch shape can;
    the checkpoint routes densely so that no near-tie of a top-k choice adds to that."""
    torch.set_num_threads(1)
    ckpt, quant, outs = two_ranks[variant]
    ref_model = load_model(ckpt, quantization=quant)
    ref = run_model(ref_model)
    tol = {key: 1e-5 for key in ref}
    if quant == "w8a8":
        fp32 = run_model(load_model(two_ranks["none"][0]))
        tol = {key: (ref[key] - fp32[key]).abs().max().item() for key in ("whole", "stateful", "mtp")}
    full_bytes = sum(t.numel() * t.element_size() for t in ref_model.state_dict().values())
    for res in outs:  # every rank ends with the same gathered logits
        for key in ("whole", "stateful", "mtp"):
            assert (res[key] - ref[key]).abs().max().item() <= tol[key], (key, tol[key])
            if quant == "none":
                assert torch.equal(res[key].argmax(-1), ref[key].argmax(-1)), key
    sizes = [int(r["weight_bytes"]) for r in outs]
    assert all(s < full_bytes for s in sizes), (sizes, full_bytes)  # no rank holds the whole model
    assert sum(sizes) > full_bytes  # replicated parts count on every rank


def test_four_ranks_equal_one(tmp_path: Path):
    """T = 4: one attention head, one output group, two index heads and two experts per rank."""
    from tests.model.tiny import TP4

    torch.set_num_threads(1)
    ckpt = tmp_path / "ck"
    write_tiny_checkpoint(ckpt, with_tokenizer=False, vocab_size=256, **TP4)
    ref = run_model(load_model(ckpt))
    for res in [o[f"{ckpt}:none"] for o in run_parallel([(ckpt, "none")], tmp_path, world=4)]:
        for key in ("whole", "stateful", "mtp"):
            torch.testing.assert_close(res[key], ref[key], rtol=1e-5, atol=1e-5, msg=key)
            assert torch.equal(res[key].argmax(-1), ref[key].argmax(-1)), key


def test_bad_world_size_is_refused():
    from tests.model.tiny import tiny_config

    with pytest.raises(sharding.ParallelError, match=r"--tensor-parallel-size 3 does not divide the model's attention heads \(4\)"):
        sharding.check_sizes(tiny_config(), 3)
