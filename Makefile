# Quick start: `make bench` runs the main benchmark, `make test` runs the tests; both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch for machines that have none: the CPU build where it is available, any torch otherwise.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-gpu bench test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[bench,test]"
	# FlashInfer's Python package: its JIT module specs are tested on CPU too. Its GPU-only dependencies
	# (CUTLASS DSL, cuDNN frontend) come with ".[gpu]" below, on machines with a GPU.
	$(PY) -m pip install -q --no-deps "flashinfer-python==0.6.14" "apache-tvm-ffi==0.1.11" "cuda-tile==1.7.0"
	$(PY) -m pip install -q einops ninja tabulate nvidia-ml-py requests
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q -e ".[gpu,bench,test]"; fi
	touch $@

install: $(VENV)/.installed

bench: install
	$(VENV)/bin/moeserve bench $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) bench-results .pytest_cache
