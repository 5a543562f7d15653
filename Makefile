# specfx — set-up, demo and tests. Only Python and pip are needed on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast gpu-check gpu-check-dry clean

setup: $(STAMP)

# torch==2.13.0 first: where its CPU build lies on disk pip takes it; the project's own
# range (torch>=2.11) is then already satisfied and nothing bigger is downloaded.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0 || $(PIP) install --quiet "torch>=2.11"
	$(PIP) install --quiet -e ".[dev,onnx]"
	$(PY) -c "import specfx, specfx.passes, specfx.runtime"
	touch $(STAMP)

demo: setup
	$(PY) -m specfx.demo

# One worker per core (pytest-xdist); each worker runs torch on one thread (tests/conftest.py).
test: setup
	$(PY) -m pytest -q -n auto --durations=25

test-fast: setup
	$(PY) -m pytest -q -n auto -m "not slow"

# On a CUDA machine with torch/transformers/triton preinstalled (no network needed).
gpu-check:
	bash scripts/gpu_check.sh

# The same check on this CPU: tiny shapes, CUDA parts recorded as skipped.
gpu-check-dry: setup
	PYTHON=$(PY) bash scripts/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) build *.egg-info
