#!/usr/bin/env bash
# One command: set up the virtual environment (CPU torch, test extras) and run the whole suite.
#   ./test.sh                 every test, in three pytest runs side by side (below)
#   ./test.sh [pytest args]   just pytest with those arguments
#
# The three runs: tests/e2e (mostly waiting on the dsv4 processes it starts; a few of its
# files, `late_e2e`, run last in the third run instead), tests/unit + tests/model
# (arithmetic), and the exactness tier (`-m exact`: chunked = whole, MTP on =
# off, seeded output, T = 2 = T = 1, ...) again under the CPU kernels of other machines:
# ATEN_CPU_CAPABILITY=avx2 with MKL and oneDNN held to AVX2 (as on an AMD EPYC without VNNI)
# and =default (no SIMD; MKL SSE4_2, oneDNN SSE41), so a promise that holds only on this
# CPU's kernels fails here too. Each run writes its
# own log, shown in full when it ends, with its slowest tests (--durations: where the suite's
# time goes); the exit status is non-zero if any run failed.
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh test >&2
scripts/browser.sh  # chromium for the chat page's tests (a no-op when installed; they skip without it)
py="${DSV4_VENV:-.venv}/bin/python"
if [ "$#" -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi

# The three runs share the machine's cores: inductor's builds (the compiled-bucket tests)
# compile one file at a time instead of one per core, so that they do not starve the daemons
# the e2e run times its expectations against.
export TORCHINDUCTOR_COMPILE_THREADS=1
logs="$(mktemp -d -t dsv4-test.XXXXXX)"
trap 'rm -rf "$logs"' EXIT
start=$SECONDS

# e2e files the third run takes once its exactness tiers are done (they finish first), so
# that the e2e run does not set the suite's time alone
late_e2e=(tests/e2e/test_http_tokenize.py tests/e2e/test_http_logprobs.py tests/e2e/test_http_structured.py
          tests/e2e/test_run_tools.py)

# On a CPU whose own kernels are AVX2's (torch picks AVX2, and no AVX-512 or AVX-VNNI for
# MKL and oneDNN to reach for), the unit + model run has already run the tier under exactly
# the kernels the avx2 pass would force: that pass is skipped, and the log says so.
caps="avx2 default"
if [ "$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = AVX2 ] &&
   ! grep -qE '^flags.* (avx512f|avx_vnni)( |$)' /proc/cpuinfo; then
  caps="default"
fi

tier() {
  local status=0 cap mkl dnnl
  [ "$caps" = default ] && echo "== the exactness tier under avx2: run by the unit + model run (this CPU's own kernels are AVX2's)"
  for cap in $caps; do
    mkl=AVX2 dnnl=AVX2
    [ "$cap" = default ] && mkl=SSE4_2 dnnl=SSE41
    echo "== the exactness tier under ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=$mkl ONEDNN_MAX_CPU_ISA=$dnnl"
    ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=$mkl ONEDNN_MAX_CPU_ISA=$dnnl OMP_NUM_THREADS=1 \
      "$py" -m pytest -p no:cacheprovider --durations=15 -m exact || status=1
  done
  echo "== e2e: ${late_e2e[*]}"
  "$py" -m pytest -p no:cacheprovider --durations=10 "${late_e2e[@]}" || status=1
  return $status
}

"$py" -m pytest -p no:cacheprovider --durations=25 tests/e2e "${late_e2e[@]/#/--ignore=}" >"$logs/e2e" 2>&1 &
e2e=$!
"$py" -m pytest -p no:cacheprovider --durations=25 tests/unit tests/model >"$logs/model" 2>&1 &
model=$!
tier >"$logs/tier" 2>&1 &
exact=$!

failed=()
summary=()
for run in model e2e exact; do
  pid=${!run}
  status=0
  wait "$pid" || status=$?
  summary+=("== $run: exit $status, done after $((SECONDS - start)) s")
  [ "$status" -eq 0 ] || failed+=("$run")
done
for log in model e2e tier; do
  echo "================================ $log"
  cat "$logs/$log"
done
printf '%s\n' "${summary[@]}"
echo "== the whole suite took $((SECONDS - start)) s"
# pytest's closing lines of the four runs, added up
count() {
  grep -hE '^(=+ )?[0-9]+ (passed|failed|skipped)' "$logs/model" "$logs/e2e" "$logs/tier" |
    grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}'
}
echo "all: $(count passed) passed, $(count failed) failed, $(count skipped) skipped"
if [ "${#failed[@]}" -ne 0 ]; then
  echo "test.sh: failed: ${failed[*]}" >&2
  exit 1
fi
