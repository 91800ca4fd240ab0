#!/usr/bin/env bash
# One command: set up a virtual environment (CPU torch) and run the whole test suite.
#   ./test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DSV4_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# The CPU build of torch; the package itself accepts any torch>=2.4 (CUDA, NPU).
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
exec "$VENV/bin/python" -m pytest "$@"
