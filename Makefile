# `make quickstart` runs the whole lifecycle, `make test` runs the whole suite, `make test-fast`
# its unit tier.
# Each creates the virtual environment first if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; set TORCH_SPEC="torch==2.13.0" (or a CUDA build) on GPU machines as needed.
TORCH_SPEC ?= torch==2.13.0
WORKDIR ?= work/quickstart
PYTEST_ARGS ?=

.PHONY: env quickstart lint test test-fast clean

env: $(VENV)/.installed

# torch first and pinned, so that nothing later resolves an unpinned torch to a CUDA wheel;
# DeepSpeed without build isolation, so that its build sees that torch instead of fetching another.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.19,<0.20"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

quickstart: env
	$(VENV)/bin/lmfoundry quickstart --workdir $(WORKDIR)

# ruff (lint and format) and the import contracts (the layering), as configured in pyproject.toml
lint: env
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check lmfoundry tests benchmarks
	$(VENV)/bin/ruff format --check lmfoundry tests benchmarks

# pytest exits 5 when it collects nothing (e.g. a -k that matches no test): say so, and fail.
# Bytecode first: where PYTHONDONTWRITEBYTECODE is set, every Ray worker would otherwise compile
# the package anew (about 0.4 s of CPU each, hundreds of workers in a run of the suite).
test: env lint
	$(PY) -m compileall -q lmfoundry tests benchmarks
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# The unit tier alone, in minutes: no Ray, no DeepSpeed workers, no servers, no subprocess
# clusters. tests/conftest.py marks each test by the fixtures it uses (TIER_FIXTURES); a test
# none of them marks is a unit test. No lint: `make lint` for that.
FAST_MARKERS := not ray and not deepspeed and not slow and not server and not postgres
test-fast: env
	$(PY) -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV) work
