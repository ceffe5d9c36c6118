# `make check` is what CI runs after installing: format, lint, types, tests.
.PHONY: check format lint types test bench

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
