# The two set-up commands of the README: `make demo` and `make test`.
# Both create the local virtual environment .venv (if missing) and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BACKENDS ?= jax tensorflow torch
# Two pytest-xdist workers: much of the suite is single-threaded (tracing, XLA compiling,
# subprocesses), so on the 2-core CI machine two overlap (JAX suite 24:16 -> 16:56).
WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: demo test venv
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[jax,tensorflow,torch,text,test,examples]"
	touch $@

# The toy translation demo under JAX.
demo: venv
	KERAS_BACKEND=jax $(PY) examples/toy_translation.py

# The whole test suite once per backend, each in its own process; fails if any backend fails.
test: venv
	@status=0; for backend in $(BACKENDS); do \
	  echo "=== pytest with KERAS_BACKEND=$$backend ==="; \
	  KERAS_BACKEND=$$backend $(PY) -m pytest -n $(WORKERS) $(PYTEST_ARGS) || status=1; \
	done; exit $$status
