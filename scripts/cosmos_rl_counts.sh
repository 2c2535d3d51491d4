#!/usr/bin/env bash
# The cosmos-rl 0.4.7 counts side by side (unguarded / as shipped / guarded), in one command:
# sets up .venv-cosmos (first run only) and runs benchmarks/cosmos_rl_guard.py "$@", e.g. --json
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cosmos_venv.sh
exec .venv-cosmos/bin/python benchmarks/cosmos_rl_guard.py "$@"
