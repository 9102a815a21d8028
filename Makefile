# One entry point for a fresh machine. `make demo` runs kiln's main job on the bundled example
# (bake → restore → verify, on CPU); `make test` runs lint and the whole test suite (what CI
# runs); `make test-fast` runs lint and the tests that are neither `slow` (real torch.compile in
# fresh processes) nor `gpu`, for the edit-test loop. Both spread the tests over JOBS pytest-xdist
# workers (default: one per core; JOBS=0 runs them in this process); an idle worker takes queued
# tests from a busy one (worksteal), so one long bake does not end the run alone.
PYTHON ?= python3
JOBS ?= auto
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned CPU build goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: venv lint bytecode test test-fast demo clean gpu-wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(BIN)/ruff check src tests examples scripts
	$(BIN)/ruff format --check src tests examples scripts

# kiln's own bytecode, written once: an editable install gets none from pip, and where the
# machine sets PYTHONDONTWRITEBYTECODE (CI's does) no process of the run writes it, so each of
# the run's several hundred kiln processes compiled kiln.compiler's modules from source again.
bytecode: venv
	$(BIN)/python -m compileall -q src examples

test: lint bytecode
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal

test-fast: lint bytecode
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal -m "not slow and not gpu"

demo: venv
	$(BIN)/kiln bake configs/tiny-gpt.yaml -o out/tiny-gpt.kiln.tar.zst
	$(BIN)/kiln inspect out/tiny-gpt.kiln.tar.zst
	$(BIN)/kiln restore out/tiny-gpt.kiln.tar.zst --dest out/cache
	$(BIN)/kiln check out/cache
	$(BIN)/kiln verify configs/tiny-gpt.yaml --cache out/cache --order shuffle

clean:
	rm -rf out $(VENV)

# The GPU machine (torch 2.11, Python 3.12, no network) lacks a few of kiln's dependencies:
# fetch them as wheels into .whl/, which scripts/gpu-run.sh installs there.
gpu-wheels: venv
	$(BIN)/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zstandard pydantic
