# `make check` is what CI runs after installing: format, lint, types, tests.
.PHONY: check format lint types test bench fuzz

check: format lint types test

format:
	.venv/bin/ruff format --check shared worker sweeper migrations scripts tests

lint:
	.venv/bin/ruff check shared worker sweeper migrations scripts tests

types:
	.venv/bin/mypy

test:
	.venv/bin/pytest -n 2

bench:
	.venv/bin/python scripts/bench.py

# The fuzz tests with many more examples, from fresh seeds (CI runs a short, fixed set).
fuzz:
	AGENTBUS_FUZZ=long .venv/bin/pytest -n 2 tests/test_fuzz*.py
