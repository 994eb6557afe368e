#!/usr/bin/env bash
# One prepared GPU check for a single H200 (or any CUDA GPU), within 8 minutes:
#   - a ~1B-parameter random-weight Llama (no download: nothing outside can be reached there),
#   - paged and flash against transformers and model.generate(): identical greedy tokens (float32),
#   - tokens/s per backend at batch 1, 32 and 128 (bfloat16).
# Python packages the machine lacks (transformers >= 5.24, flash-attn, pluggy, ...) travel as wheels
# in .whl/ (see the device tool's README); the script installs them and tokenmill into /tmp first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
site=/tmp/tokenmill-site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" .
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 480 python3 bench/gpu_check.py "$@"
