# The two commands a newcomer needs: `make up` (the local stack) and `make test`.
# `make images` builds the engine (FLAVOR=auto: cpu where the CPU torch wheel is on local disk, else
# cuda, PyPI's torch, which runs on a CPU too), EPP and operator
# images into dist/images/*.oci.tar; `make images-test` runs them (pytest -m images).
.PHONY: setup up test lint images images-test cluster

setup:
	@scripts/setup.sh

up: setup
	@.venv/bin/kvgate up

test:
	@scripts/test.sh

lint: setup
	@.venv/bin/ruff check . && .venv/bin/ruff format --check . && scripts/typecheck.sh

FLAVOR ?= auto

images:
	@FLAVOR=$(FLAVOR) scripts/images.sh

images-test: setup
	@FLAVOR=$(FLAVOR) .venv/bin/pytest tests/images -m images -p no:cacheprovider

# A real control plane (etcd, kube-apiserver, controller-manager, scheduler) and Envoy Gateway on
# 127.0.0.1, built from Go modules on first use (tools/cluster and tools/gateway, ~15 min cold):
# prints the Gateway's address and `cluster ready`; Ctrl-C stops.
cluster: setup
	@scripts/cluster.sh
