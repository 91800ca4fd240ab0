#!/usr/bin/env bash
# One command: set up the virtual environment (CPU torch, test extras) and run the whole suite.
#   ./test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh test >&2
exec "${DSV4_VENV:-.venv}/bin/python" -m pytest "$@"
