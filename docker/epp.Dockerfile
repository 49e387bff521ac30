# kvgate endpoint picker: slim Python, no torch, non-root, runs with a read-only root filesystem.
# Build from the repository root:  docker build -f docker/epp.Dockerfile -t ghcr.io/kvgate/epp:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgate
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvgate ./kvgate
COPY api ./api
COPY epp ./epp
RUN /opt/kvgate/bin/pip install ".[epp]"

FROM python:3.11-slim
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
COPY --from=build /opt/kvgate /opt/kvgate
WORKDIR /tmp
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["kvgate"]
CMD ["epp", "serve", "--help"]
