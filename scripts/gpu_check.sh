#!/usr/bin/env bash
# The prepared run for a lent NVIDIA machine (one call, a few minutes): the CUDA exactness
# tests, the step-cost table on CUDA (the costs auto K weighs), eager against the captured
# dispatch of --compile replayed as CUDA graphs (mode reduce-overhead, state tensors marked
# static), then the benchmark suite on CUDA, logs and tables into OUT.
#
#   bash scripts/gpu_check.sh OUT [DATA]
#
# That machine has its own python3 with torch and most of dsv4's needs but nothing can be
# fetched there: carry the missing wheels (pyzmq; transformers >= 5.23 for the comparison)
# in .whl/ (see the device tool's README), and a copy of the held-out texts as DATA
# (benchmarks/run.py --data: a folder with heldout/*.txt).
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT [DATA]}
DATA=${2:-../shared/data/shakespeare}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log"
python3 benchmarks/step_costs.py --device cuda --iters 100 2>&1 | tee "$OUT/step_costs.log"
XDG_CACHE_HOME=/tmp/dsv4-gpu-cache timeout 480 python3 benchmarks/step_costs.py --device cuda --iters 100 --compile \
    --compile-mode reduce-overhead 2>&1 | tee "$OUT/step_costs_cuda_graphs.log"
python3 benchmarks/run.py --device cuda --data "$DATA" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
# tensor parallelism at T = 1 on the one lent GPU (the collectives are no-ops; T = 2 needs two devices),
# then the gloo T = 2 exactness tests on the host's CPUs
# then the gloo T = 2 (and 4) exactness tests, the shared-memory plan channel and auto K at T = 2 on the
# host's CPUs, and torchrun's launch path on the GPU (one process: WORLD_SIZE 1, `run` implies --local)
python3 benchmarks/parallel.py --device cuda --sizes 1 2>&1 | tee "$OUT/parallel.log"
python3 -m pytest -q -p no:cacheprovider tests/model/test_parallel.py tests/model/test_transport.py \
    tests/model/test_parallel_engine.py 2>&1 | tee "$OUT/parallel_tests.log"
python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29571 -m dsv4.cli.main run --device cuda \
    --max-tokens 16 --ignore-eos --raw "Hamlet:" 2>&1 | tee "$OUT/torchrun.log"
