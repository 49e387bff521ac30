# kvgate operator: slim Python with kopf, non-root, runs with a read-only root filesystem.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t ghcr.io/kvgate/operator:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgate
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvgate ./kvgate
COPY api ./api
COPY operator ./operator
RUN /opt/kvgate/bin/pip install ".[operator]"

FROM python:3.11-slim
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /opt/kvgate /opt/kvgate
WORKDIR /tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["operator", "run"]
