# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install what they need first. Override the torch version with TORCH_SPEC=...
# and pick its build (CPU-only, or a CUDA version) with TORCH_INDEX=<PyTorch wheel index> (README).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench install clean

$(STAMP): pyproject.toml setup.py schedcomp/solvers/_listloop.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	# (A stale compiled list loop would stay where a rebuild fails: the optional extension hides the failure.)
	rm -f schedcomp/solvers/_listloop*.so
	$(PY) -m pip install -q -e ".[test]"
	# Bytecode for the package itself (an editable install leaves none, and with PYTHONDONTWRITEBYTECODE set none
	# is ever written: every CLI run then compiles ~60 modules again, a quarter of a second at startup).
	$(PY) -m compileall -q schedcomp > /dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m schedcomp.runtime.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The in-process tests on every core first; then the `slow` ones (whole jobs, mostly waiting on
# heartbeats, deaths and stores rather than computing) two at a time: every job has its own store
# port, temporary folders and network namespaces, so neighbours cannot meet (bench/README.md, CI).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" -n auto
	$(PY) -m pytest -q -m slow -n 2 --durations=15

# Everything but the tests marked `slow` (worker processes, whole jobs, > ~5 s), on every core (pytest-xdist).
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" -n auto

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
