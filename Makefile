# The two commands a newcomer needs: `make up` (the local stack) and `make test`.
.PHONY: setup up test lint

setup:
	@scripts/setup.sh

up: setup
	@.venv/bin/kvgate up

test:
	@scripts/test.sh

lint: setup
	@.venv/bin/ruff check . && .venv/bin/ruff format --check . && scripts/typecheck.sh
