# kvgate endpoint picker: Debian's python3, no torch, non-root, runs with a read-only root filesystem.
# Build from the repository root:  docker build -f docker/epp.Dockerfile -t ghcr.io/kvgate/epp:0.1.0 .
# `make images` builds it without Docker, FROM a local debootstrap of the same Debian release
# (--build-arg BASE_IMAGE=...), which already has python3 and its venv module.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN python3 -c "import ensurepip" 2>/dev/null \
    || { apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/kvgate
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvgate ./kvgate
COPY api ./api
COPY epp ./epp
# the gateway's code (the model router, `kvgate router serve`, and the Envoy bootstrap builder)
# runs on the EPP's ext_proc plumbing and extra: it ships in this image
COPY gateway ./gateway
# pip_ca: an optional build secret, the CA bundle of a TLS-intercepting proxy between the build
# and PyPI (`make images` passes the host's PIP_CERT); absent on a forge.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && /opt/kvgate/bin/pip install ".[epp]"

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN command -v python3 >/dev/null \
    || { apt-get update && apt-get install -y --no-install-recommends python3 ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }
# A passwd entry for the numeric USER: kopf and torch ask getpass.getuser(), which fails for a
# uid with none (KeyError: getpwuid(): uid not found: 65532).
RUN groupadd --system --gid 65532 kvgate \
    && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
RUN kvgate epp serve --help >/dev/null && kvgate router serve --help >/dev/null
WORKDIR /tmp
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["kvgate"]
CMD ["epp", "serve", "--help"]
