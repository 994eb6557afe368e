#!/usr/bin/env bash
# The worked example: three models behind one gateway, each in its own Deployment and Service
# (k8s/models.yaml), routed by the x-model header. Writes nginx.conf and envoy.yaml next to this
# script; k8s/gateway.yaml's ConfigMap holds the same nginx.conf (tests/test_gateway.py checks both).
set -euo pipefail
cd "$(dirname "$0")"
models=(
  --model smollm2=http://tokenmill-smollm2:80,timeout=120,max-connections=64
  --model qwen2.5-7b=http://tokenmill-qwen2-5-7b:80,timeout=600,max-connections=128
  --model llama-3.1-8b=http://tokenmill-llama-3-1-8b:80,timeout=900,max-connections=128
)
python -m tokenmill gateway-config --format nginx --listen 0.0.0.0:8080 "${models[@]}" > nginx.conf
python -m tokenmill gateway-config --format envoy --listen 0.0.0.0:8080 "${models[@]}" > envoy.yaml
