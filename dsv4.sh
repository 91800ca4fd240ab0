#!/usr/bin/env bash
# One command: set up the virtual environment if needed (CPU torch, the http extra for
# `serve --http`), then run the dsv4 CLI.
#   ./dsv4.sh run --local "ROMEO:"
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/scripts/venv.sh" http >&2
venv=${DSV4_VENV:-.venv}
case "$venv" in /*) ;; *) venv="$here/$venv" ;; esac
exec "$venv/bin/dsv4" "$@"
