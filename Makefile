# Two entry points for a fresh clone: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
DEPS := "setuptools>=64" "wheel" "torch==2.11.0" "numpy" "pytest" "ninja" "nvidia-cutlass" "matplotlib" "expecttest" "transformers>=5"

.PHONY: deps build install test test-fast asan demo kernel-demo bench clean

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

# The CPU build under AddressSanitizer and UBSan, in a copy of the package under build/asan (the
# regular build is untouched), running the test suite: an out-of-bounds access or undefined
# behaviour in the op layer or the CPU kernels aborts the run (tests/test_argument_fuzz.py feeds
# them spoiled arguments). GPU tests skip there; on a GPU, compute-sanitizer does this job.
ASAN_CXXFLAGS := -mavx2 -mfma -mf16c -DCPU_CAPABILITY_AVX2 -fsanitize=address,undefined \
	-fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1
asan: deps
	FLASH_ATTN_CUDA=0 FLASH_ATTN_CPU_FLAGS="$(ASAN_CXXFLAGS)" LDFLAGS="-fsanitize=address,undefined" \
		$(PYTHON) setup.py build_ext --build-lib build/asan/lib --build-temp build/asan/tmp
	rm -rf build/asan/pkg && mkdir -p build/asan/pkg && cp -r flash_attn build/asan/pkg/
	rm -f build/asan/pkg/flash_attn/_C*.so && cp build/asan/lib/flash_attn/_C*.so build/asan/pkg/flash_attn/
	cd build/asan/pkg && LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so):$$($(CXX) -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		$(PYTHON) -m pytest $(CURDIR)/tests -q -p no:cacheprovider

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
