"""`dsv4 plan`: the memory a configuration needs, part by part, before anything loads.

The engine flags that size memory (`--quantization`, `--dtype`, `--max-model-len`,
`--max-num-seqs`, `--num-speculative-tokens`, `--tensor-parallel-size`, `--kv-cache-memory`,
`--compile`: a build in this process holds a second copy of the weights)
go into an `EngineConfig` as `serve` would build it, over a checkpoint directory or its
`config.json` alone (then the weights are taken as the official layout stores them);
`dsv4.engine.memory_plan` does the sums. `--memory` plans for another machine.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from dsv4.cli import options as O
from dsv4.cli.options import CliError

PlanMemory = Annotated[Optional[str], typer.Option(
    "--memory", metavar="SIZE", show_default=False,
    help="Plan for a machine with this much memory (e.g. 192GiB) [default: this machine's available memory]")]


def plan(model: O.Model = None, revision: O.Revision = None, device: O.Device = None, dtype: O.Dtype = None,
         quantization: O.Quantization = None, max_model_len: O.MaxModelLen = None,
         max_num_seqs: O.MaxNumSeqs = None, max_num_batched_tokens: O.MaxBatched = None,
         num_speculative_tokens: O.NumSpec = None, tensor_parallel_size: O.TensorParallel = None,
         data_parallel_size: O.DataParallel = None, kv_cache_memory: O.KvCacheMemory = None, nnodes: O.NNodes = None, compile: O.Compile = None,
         memory: PlanMemory = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False) -> None:
    """Print the memory a configuration needs (weights by kind and format, the state pool, the
    rings, activations, a --compile build) against the machine's, before loading anything; exit 1 when it does not fit."""
    from dsv4.engine.checks import EngineConfigError, parse_memory
    from dsv4.engine.memory_plan import memory_plan

    kw = O.engine_kwargs(model=model, revision=revision, device=device, dtype=dtype, quantization=quantization,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=num_speculative_tokens,
                         tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                         kv_cache_memory=kv_cache_memory, nnodes=nnodes, compile=compile)
    try:
        size = parse_memory(memory, "cpu") if memory is not None else None
    except EngineConfigError as e:
        raise CliError(str(e).replace("--kv-cache-memory", "--memory"), O.EXIT_USAGE) from None
    if nnodes is not None and nnodes > 1:
        kw.update(master_addr="127.0.0.1", master_port=1)  # planning: no rendezvous happens
    config = O.build_config({**kw, "planning": True, "memory": size}, check_memory=False)
    p = memory_plan(config, available=size)
    if as_json:
        print(json.dumps({"quantization": config.quantization, "dtype": config.dtype,
                          "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                          "tensor_parallel_size": config.tensor_parallel_size,
                          "data_parallel_size": config.data_parallel_size, "ranks_here": p.ranks_here,
                          "parts": [{"what": x.what, "bytes": x.bytes, "detail": x.detail} for x in p.parts],
                          "per_rank_bytes": p.per_rank, "host_bytes": p.host_bytes, "available_bytes": p.available,
                          "fits": p.fits()}, indent=1))
    else:
        print(f"{config.model}: {config.quantization}, {config.dtype}, --max-model-len {config.max_model_len}, "
              f"--max-num-seqs {config.max_num_seqs}, --tensor-parallel-size {config.tensor_parallel_size}"
              + (f", --data-parallel-size {config.data_parallel_size}" if config.data_parallel_size > 1 else ""))
        print(p.render())
    if not p.fits():
        raise typer.Exit(O.EXIT_ERROR)
