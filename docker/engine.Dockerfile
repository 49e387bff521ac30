# kvgate engine: torch + triton, kvgate[engine], non-root, runs with a read-only root filesystem.
# Build from the repository root:  docker build -f docker/engine.Dockerfile -t ghcr.io/kvgate/engine:0.1.0 .
# FLAVOR=cuda (default, the chart's image): torch from PyPI, whose Linux wheels are CUDA builds
# that bring their own CUDA libraries, so a plain Debian base serves; the kernels JIT-compile at
# start-up, so the image keeps a C compiler and Python's headers (triton builds its launcher).
# FLAVOR=cpu: the CPU torch wheel placed in docker/wheels/ (`make images` does it), no compiler.
# Every cache points at /tmp: the root filesystem stays read-only.
# `make images` builds it without Docker, FROM a local debootstrap of the same Debian release
# (--build-arg BASE_IMAGE=...), which already has python3 and its venv module.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE} AS build
ARG FLAVOR=cuda
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN python3 -c "import ensurepip" 2>/dev/null \
    || { apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/kvgate
COPY docker/wheels/ /wheels/
# cpu: only the local wheel's +cpu build matches; cuda: PyPI's torch (a public version, so
# pip never takes the +cpu wheel for it: /wheels is not searched).
# pip_ca: an optional build secret, the CA bundle of a TLS-intercepting proxy between the build
# and PyPI (`make images` passes the host's PIP_CERT); absent on a forge.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    case "$FLAVOR" in \
      cpu) /opt/kvgate/bin/pip install --find-links /wheels "torch==${TORCH_VERSION}+cpu" ;; \
      cuda) /opt/kvgate/bin/pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "FLAVOR must be cpu or cuda, not '$FLAVOR'" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvgate ./kvgate
COPY api ./api
COPY engine ./engine
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && /opt/kvgate/bin/pip install ".[engine]"

FROM ${BASE_IMAGE}
ARG FLAVOR=cuda
ENV DEBIAN_FRONTEND=noninteractive
RUN if [ "$FLAVOR" = cuda ]; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    elif ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# A passwd entry for the numeric USER: kopf and torch ask getpass.getuser(), which fails for a
# uid with none (KeyError: getpwuid(): uid not found: 65532).
RUN groupadd --system --gid 65532 kvgate \
    && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
# Fails the build, naming the step, if torch or triton cannot be imported.
RUN python -c "import torch, triton, kvgate.engine.llm_engine; print('torch', torch.__version__, 'triton', triton.__version__)"
WORKDIR /tmp
USER 65532:65532
EXPOSE 8000 5557
ENTRYPOINT ["kvgate"]
CMD ["engine", "serve", "--help"]
