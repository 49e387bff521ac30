# kvgate engine: CUDA runtime, torch (CUDA build) + triton, kvgate[engine].
# Build from the repository root:  docker build -f docker/engine.Dockerfile -t ghcr.io/kvgate/engine:0.1.0 .
# The kernels JIT-compile at start-up, so the image keeps a C compiler (triton builds its
# launcher with it) and points every cache at /tmp: the root filesystem stays read-only.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.9.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvgate \
    PATH=/opt/kvgate/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvgate ./kvgate
COPY api ./api
COPY engine ./engine
RUN pip install ".[engine]" && rm -rf /src

WORKDIR /tmp
USER 65532:65532
EXPOSE 8000 5557
ENTRYPOINT ["kvgate"]
CMD ["engine", "serve", "--help"]
