#!/usr/bin/env bash
# The test command: sets up .venv (first run only) and runs the whole suite.
# Extra arguments go to pytest, e.g. ./run_test.sh -k gate -x
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_venv.sh
exec .venv/bin/python -m pytest "$@"
