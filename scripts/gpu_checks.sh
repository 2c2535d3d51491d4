#!/usr/bin/env bash
# The device checks, for a machine with a CUDA GPU (never CI): the CUDA-marked tests and the
# weight-sync timer's host-sync count. Runs with the machine's own python3 and torch, from the
# checkout (PYTHONPATH=.), without installing anything; prints everything it measures.
#   bash scripts/gpu_checks.sh            # on the GPU machine, in the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
status=0
python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="-ra" tests || status=$?
# The timer must add zero host-device synchronizations to a training loop.
python3 benchmarks/timer_overhead.py --device cuda || status=$?
exit $status
