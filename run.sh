#!/usr/bin/env bash
# The main job: sets up .venv (first run only) and runs `rollout-sync "$@"`, e.g. ./run.sh demo
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_venv.sh
exec .venv/bin/rollout-sync "$@"
