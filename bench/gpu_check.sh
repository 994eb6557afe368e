#!/usr/bin/env bash
# One prepared GPU check for a single H200 (or any CUDA GPU), within 9.5 minutes:
#   - a ~1B-parameter random-weight Llama (no download: nothing outside can be reached there),
#   - paged and flash against transformers and model.generate(): identical greedy tokens (float32),
#   - tokens/s per backend at batch 1, 32 and 128 (bfloat16),
#   - each quantizer (int8, int4, gptq, awq, fp8, bitsandbytes int8 and nf4): weight memory, tokens/s at
#     batch 32, top-1 agreement with bfloat16. Carry a bitsandbytes wheel in .whl/ for those two,
#   - --num-shard 2 (NCCL) against --num-shard 1 through the server: identical greedy texts. Two ranks on
#     one GPU may be refused by NCCL ("duplicate GPU"); the script reports it and goes on. Carry llguidance,
#     falcon, uvicorn and pluggy wheels if the image lacks them.
# Python packages the machine lacks travel as wheels in .whl/ (see the device tool's README); the
# script installs them and tokenmill into /tmp first. The H200 image has torch, tokenizers,
# safetensors, huggingface-hub and pluggy but an older transformers, so carry at least
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.24.0
# and, for the flash backend, a flash-attn wheel built for that image's torch and CUDA (without it the
# script says "flash: unavailable" and checks transformers and paged only).
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
timeout 570 python3 bench/gpu_check.py "$@"
