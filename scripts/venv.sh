#!/usr/bin/env bash
# Create .venv (if needed) and install dsv4 into it with the CPU build of torch.
#   scripts/venv.sh [EXTRAS]     e.g. scripts/venv.sh http (what ./dsv4.sh installs: serve --http),
#                                     scripts/venv.sh test (what ./test.sh installs: http and plot included),
#                                     scripts/venv.sh http,plot (bench --plot)
# DSV4_VENV names another environment directory (default .venv, relative to the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DSV4_VENV:-.venv}
extras=${1:-}
stamp="$VENV/.dsv4-installed${extras:+-$extras}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # The CPU build of torch; the package itself accepts any torch>=2.4 (CUDA, NPU).
  pip_q "torch==2.13.0"
  pip_extras=$(echo ",$extras," | sed -e 's/^,*//' -e 's/,*$//')
  pip_q -e ".${pip_extras:+[$pip_extras]}"
  "$VENV/bin/python" -c "import dsv4, torch" && touch "$stamp"
fi
# The fp4 GEMM extension (dsv4/model/fp4_kernel.py), compiled into the per-user cache
# ($XDG_CACHE_HOME/dsv4/ext): again when its source or the install changed, or its .so is
# gone. A failed build prints one line and leaves the torch fallback; set-up goes on.
fp4_stamp="$VENV/.dsv4-fp4-ext"
fp4_so=$(cat "$fp4_stamp" 2>/dev/null || true)
if [ ! -f "$fp4_stamp" ] || [ -n "$(find dsv4/model/csrc -newer "$fp4_stamp" 2>/dev/null)" ] || [ dsv4/model/fp4_kernel.py -nt "$fp4_stamp" ] ||
   [ "$stamp" -nt "$fp4_stamp" ] ||
   { [ -n "$fp4_so" ] && [ ! -f "$fp4_so" ]; }; then
  "$VENV/bin/python" -c 'import sys; from dsv4.model import fp4_kernel; sys.exit(fp4_kernel.main(sys.argv[1:]))' \
    --build --stamp "$fp4_stamp" || true
fi
