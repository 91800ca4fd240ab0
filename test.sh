#!/usr/bin/env bash
# One command: set up the virtual environment (CPU torch, test extras) and run the whole suite.
#   ./test.sh                 the suite, then its exactness tier (`-m exact`) under the CPU
#                             kernels of other machines: ATEN_CPU_CAPABILITY=avx2 (with MKL
#                             held to AVX2, as on an AMD EPYC) and =default (no SIMD), so a
#                             promise that holds only on this CPU's kernels fails here too
#   ./test.sh [pytest args]   just pytest with those arguments
# The tier runs single-threaded beside the suite (which leaves about a core idle while it
# waits on its subprocesses); its report follows the suite's.
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh test >&2
py="${DSV4_VENV:-.venv}/bin/python"
if [ "$#" -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi

tier_log="$(mktemp -t dsv4-tier.XXXXXX)"
trap 'rm -f "$tier_log"' EXIT
(
  set +e
  status=0
  for cap in avx2 default; do
    mkl=AVX2
    [ "$cap" = default ] && mkl=SSE4_2
    echo "== the exactness tier under ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=$mkl"
    ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=$mkl OMP_NUM_THREADS=1 \
      "$py" -m pytest -m exact -p no:cacheprovider -q || status=1
  done
  exit $status
) >"$tier_log" 2>&1 &
tier=$!

suite=0
"$py" -m pytest || suite=$?
tier_status=0
wait "$tier" || tier_status=$?
cat "$tier_log"
if [ "$suite" -ne 0 ] || [ "$tier_status" -ne 0 ]; then
  echo "test.sh: the suite exited $suite, the exactness tier $tier_status" >&2
  exit 1
fi
