#!/usr/bin/env bash
# Create .venv (if needed) and install dsv4 into it with the CPU build of torch.
#   scripts/venv.sh [EXTRAS]     e.g. scripts/venv.sh http (what ./dsv4.sh installs: serve --http),
#                                     scripts/venv.sh test (what ./test.sh installs: http included)
# DSV4_VENV names another environment directory (default .venv, relative to the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DSV4_VENV:-.venv}
extras=${1:-}
stamp="$VENV/.dsv4-installed${extras:+-$extras}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # The CPU build of torch; the package itself accepts any torch>=2.4 (CUDA, NPU).
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".${extras:+[$extras]}" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import dsv4, torch" && touch "$stamp"
fi
