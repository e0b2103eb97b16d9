# Two entry points for a fresh clone: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
DEPS := "setuptools>=64" "wheel" "torch==2.11.0" "numpy" "pytest" "ninja" "nvidia-cutlass" "matplotlib" "expecttest" "transformers>=5"

.PHONY: deps build install test test-fast demo kernel-demo bench clean

deps:
	$(PIP) install -q $(DEPS)

# In-place, incremental (ninja) build of flash_attn/_C.abi3.so.
build: deps
	$(PYTHON) setup.py build_ext --inplace

# A regular install into the current environment (uses the environment's torch).
install: deps
	$(PIP) install --no-build-isolation .

test: build
	$(PYTHON) -m pytest tests -q -rs

test-fast: build
	$(PYTHON) -m pytest tests -q -rs -m "not slow"

# GPT-2 trained with PyTorch's attention and with ours, same seed: loss curves, tokens/s, memory.
demo: build
	$(PYTHON) examples/gpt2/train.py

# Our attention against a float64 reference on one problem: time, memory, error.
kernel-demo: build
	$(PYTHON) examples/demo.py

bench: build
	$(PYTHON) benchmarks/benchmark_cpu.py

clean:
	rm -rf build dist *.egg-info flash_attn/_C*.so
