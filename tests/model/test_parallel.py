"""Tensor and expert parallelism on gloo (CPU, fp32): T = 2 ranks, each loading only its
slices of a tiny checkpoint, give the single-process model's logits (to 1e-5: the
all_reduces reorder sums) for the stateless forward, a chunked prefill + decode through
the slot state, and the MTP block; w8a8 too (a row-parallel int8 slice is quantised with its whole rows'
scales, so only the order of the float32 sums differs there as well); T = 4 on the
variant of the tiny config whose split dimensions divide by 4 (`tiny.TP4`)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dsv4.model import parallel, sharding
from dsv4.model.loader import load_model
from dsv4.model.state import Batch
from tests.checkpoints import write_tiny_checkpoint

WORLD = 2
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _rank_entry(rank: int, world: int, port: int, out: str, work: Callable[..., Any], args: tuple) -> None:
    """One spawned rank: join the gloo group, save `work(rank, world, *args)` to out.<rank>."""
    try:
        torch.set_num_threads(1)
        parallel.init(rank, world, "127.0.0.1", port, timeout_s=120)
        torch.save(work(rank, world, *args), f"{out}.{rank}")
        torch.distributed.barrier()  # rank 0 serves the store: it leaves the group last
        parallel.close()
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)


def spawn_ranks(work: Callable[..., Any], args: tuple, tmp: Path, world: int = WORLD) -> tuple[list[Any], list[int]]:
    """Run `work(rank, world, *args)` (a module-level function) on `world` spawned ranks of one
    gloo group; (every rank's result, the ranks' pids). Every rank must exit 0."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, str(tmp / "out"), work, args))
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


def _model_work(rank: int, world: int, ckpt: str, quant: str) -> dict[str, torch.Tensor]:
    model = load_model(ckpt, quantization=quant, rank=rank, world=world)
    res = run_model(model)
    res["weight_bytes"] = torch.tensor(sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    return res


def run_parallel(ckpt: Path, quant: str, tmp: Path, world: int = WORLD) -> list[dict[str, torch.Tensor]]:
    """Run `run_model` on `world` spawned ranks; every rank's results."""
    return spawn_ranks(_model_work, (str(ckpt), quant), tmp, world)[0]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    """FP8 linears (128x128 block scales cut through by the T = 2 slices) and FP4 experts."""
    path = tmp_path_factory.mktemp("tp") / "ck"
    write_tiny_checkpoint(path, quantize=True, num_shards=2, with_tokenizer=False, vocab_size=256)
    return path


@pytest.mark.parametrize("quant", ["none", "w8a8", "converted"])
def test_two_ranks_equal_one(fp8_checkpoint: Path, tmp_path: Path, quant: str):
    """`converted`: a `dsv4 convert` output (int8 rows + row scales on disk, sliced as stored)."""
    torch.set_num_threads(1)
    if quant == "converted":
        from dsv4.model.convert import convert_checkpoint

        convert_checkpoint(fp8_checkpoint, tmp_path / "w8a8")
        fp8_checkpoint, quant = tmp_path / "w8a8", "w8a8"
    ref_model = load_model(fp8_checkpoint, quantization=quant)
    ref = run_model(ref_model)
    full_bytes = sum(t.numel() * t.element_size() for t in ref_model.state_dict().values())
    outs = run_parallel(fp8_checkpoint, quant, tmp_path)
    for res in outs:  # every rank ends with the same gathered logits
        for key in ("whole", "stateful", "mtp"):
            torch.testing.assert_close(res[key], ref[key], rtol=1e-5, atol=1e-5, msg=key)
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
    for res in run_parallel(ckpt, "none", tmp_path, world=4):
        for key in ("whole", "stateful", "mtp"):
            torch.testing.assert_close(res[key], ref[key], rtol=1e-5, atol=1e-5, msg=key)
            assert torch.equal(res[key].argmax(-1), ref[key].argmax(-1)), key


def test_bad_world_size_is_refused():
    from tests.model.tiny import tiny_config

    with pytest.raises(sharding.ParallelError, match=r"--tensor-parallel-size 3 does not divide the model's attention heads \(4\)"):
        sharding.check_sizes(tiny_config(), 3)
