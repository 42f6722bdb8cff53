#!/usr/bin/env bash
# On a machine with a CUDA GPU and torch (with CUDA) + triton already installed (e.g. the lent H100: no
# internet, so no venv): build both extensions in place, run the GPU tests against the float64 reference,
# then the benchmarks. Results go to ${OUT:-benchmarks/results}/<gpu>.json; commit them.
#   bash scripts/gpu_check.sh            (set SKIP_BENCH=1 to run only the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
MAX_JOBS=${MAX_JOBS:-16} python setup.py build_ext --inplace 2>&1 | tail -3
python -c "import fedfast._C, fedfast._C_cuda; print('extensions OK')"
FEDFAST_GPU_TESTS=1 python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -20
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  name=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-').lower())")
  FEDFAST_BENCH_DEVICE=cuda python -m pytest benchmarks/bench_distill.py --benchmark-only -q -p no:cacheprovider \
    --benchmark-json "$OUT_DIR/$name.json" 2>&1 | tail -3
  python benchmarks/summarize.py "$OUT_DIR/$name.json"
  FEDFAST_BENCH_DEVICE=cuda python -m pytest benchmarks/bench_flat.py --benchmark-only -q -p no:cacheprovider \
    --benchmark-json "$OUT_DIR/$name-flat.json" 2>&1 | tail -3
  # issue 5: the pfl-research shape (1000 clients x 50 CIFAR-sized images, 50 per round, batch 10, simple_cnn),
  # engine vs the sequential loop, and all 1000 clients in one round
  FEDFAST_BENCH_DEVICE=cuda python -m pytest benchmarks/bench_engine.py --benchmark-only -q -p no:cacheprovider \
    --benchmark-json "$OUT_DIR/$name-engine.json" 2>&1 | tail -3
fi
