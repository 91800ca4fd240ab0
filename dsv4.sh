#!/usr/bin/env bash
# One command: set up the virtual environment if needed, then run the dsv4 CLI.
#   ./dsv4.sh run --local "ROMEO:"
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/scripts/venv.sh" >&2
exec "$here/${DSV4_VENV:-.venv}/bin/dsv4" "$@"
