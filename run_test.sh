#!/usr/bin/env bash
# The test command: sets up .venv and .venv-cosmos (first run only) and runs the whole suite:
# the main one in .venv, then tests/cosmos_rl_env (cosmos-rl 0.4.7's own code, which pins
# transformers<5 where vLLM needs >=5.16) in .venv-cosmos. Exits non-zero if either fails.
# With arguments, runs just the main suite with them, e.g. ./run_test.sh -k gate -x
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_venv.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
status=0
.venv/bin/python -m pytest || status=$?
# Set up after the main suite ran, so a failed cosmos-rl install (set -e: the command fails)
# does not keep the main suite from running.
source scripts/setup_cosmos_venv.sh
# cosmos-rl's imports warn by the dozen (pydantic, torch.jit); its tests' warnings are not ours.
.venv-cosmos/bin/python -m pytest -p no:warnings tests/cosmos_rl_env || status=$?
exit "$status"
