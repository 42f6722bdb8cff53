#!/usr/bin/env bash
# On a machine with a CUDA GPU and torch (with CUDA) + triton already installed (e.g. the lent H100: no
# internet, so no venv): build both extensions in place, run the GPU tests against the float64 reference and
# the sequential loop, then the benchmarks. Results go to ${OUT:-benchmarks/results}: <gpu>.json (fused
# losses and their eager baselines), <gpu>-compiled.json (their torch.compile baselines), <gpu>-flat.json
# (aggregate, client step), <gpu>-engine.json (pfl-research round), <gpu>-rounds.json (the round benchmark:
# engine vs the plain loop, same run), <gpu>-conv.json (per-client convolution implementations),
# <gpu>-profile.txt (where a round's time goes), <gpu>-probe.json (the fused ops' kernels and launch
# configurations), <gpu>-host.json/.txt (the host's side of a loss step), <gpu>-authors.json (fedfast bench: the authors' loss code), <gpu>-tune.json (each
# convolution kernel over candidate tiles;
# <gpu>-tuned.txt its choice, which bench-rounds then times as engine[triton+tiles]), and the whole log to
# gpu_check.log. Commit the JSON files.
#
#   bash scripts/gpu_check.sh                all stages: build test bench-distill bench-compiled bench-flat
#                                            bench-engine tune-conv bench-rounds bench-conv profile probe
#                                            host-probe bench-authors
#   bash scripts/gpu_check.sh build test     only those stages (a device call is limited to 10 minutes: split
#                                            the stages over calls)
#
# The device's copy of the repository may report an older commit than the tree it runs (seen 2026-11-25): put
# FEDFAST_COMMIT=$(git rev-parse HEAD), read here, into the device command; the round and tile JSON record it.
#
# TEST_ARGS / TUNE_ARGS / ROUNDS_ARGS / CONV_ARGS / PROFILE_ARGS / PROBE_ARGS / HOST_ARGS / AUTHORS_ARGS add arguments to those stages; TUNE_SECONDS bounds
# tune-conv (default 150) (e.g. ROUNDS_ARGS="--shapes pfl_cifar_50").
#
# A failing stage does not stop the later ones (device time is scarce); the exit status is 1 if any failed.
# STAGE_TIMEOUT (seconds, default 540) bounds each stage so that a hang still leaves the other results, and
# DEADLINE (seconds from the start, default 585: a device call is killed at 600) bounds them all: a stage gets at
# most the time left before it, and one with under 20 s left is skipped and reported, so the log and the JSON
# written so far always come back (the benchmarks write their JSON after every shape or row).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
export PYTHONUNBUFFERED=1
ALL=(build test bench-distill bench-compiled bench-flat bench-engine tune-conv bench-rounds bench-conv profile probe
     host-probe bench-authors)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL[@]}")
T=${STAGE_TIMEOUT:-540}
DEADLINE=${DEADLINE:-585}
failed=()

python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
name=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-').lower())" 2>/dev/null || echo no-gpu)

run_stage() {  # run_stage NAME "COMMAND"
  local st=$1 cmd=$2
  local left=$((DEADLINE - SECONDS - 5)) limit=$T
  if [ "$left" -lt 20 ]; then
    echo "=== $st: skipped, ${left} s left before DEADLINE=${DEADLINE} (run it in the next call)" | tee -a "$LOG"
    failed+=("$st(skipped)")
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $st (limit ${limit} s): $cmd" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" bash -c "$cmd" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $st: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && failed+=("$st")
  return 0
}

bench() {  # the command of a benchmark stage: bench FILE JSON [PYTEST_K_EXPRESSION]
  local k=""
  [ -n "${3:-}" ] && k="-k '$3'"
  echo "FEDFAST_BENCH_DEVICE=cuda python -m pytest benchmarks/$1 --benchmark-only -q -p no:cacheprovider $k" \
       "--benchmark-json $OUT_DIR/$2 && python benchmarks/summarize.py $OUT_DIR/$2"
}

for st in "${STAGES[@]}"; do
  case "$st" in
    build) run_stage build "MAX_JOBS=${MAX_JOBS:-16} FEDFAST_REQUIRE_EXT=1 python setup.py build_ext --inplace > /tmp/fedfast-build.log 2>&1 || { tail -60 /tmp/fedfast-build.log; exit 1; }; python -c 'import fedfast._C, fedfast._C_cuda; print(\"extensions OK\")'" ;;
    test) run_stage test "FEDFAST_GPU_TESTS=1 python -m pytest -q -m gpu tests/test_gpu.py -rf ${TEST_ARGS:-}" ;;
    # each convolution kernel alone over candidate tiles, against cuDNN kernel by kernel and a float64 reference;
    # its choice (<gpu>-tuned.txt) is timed by a later bench-rounds of the same call as one more engine variant
    tune-conv) run_stage tune-conv "python benchmarks/tune_conv.py --device cuda --seconds ${TUNE_SECONDS:-150} ${TUNE_ARGS:-} --out $OUT_DIR/$name-tune.json --best-out $OUT_DIR/$name-tuned.txt" ;;
    # the torch.compile baselines compile one graph per (loss, shape): their own stage and file, so that slow
    # compiles cannot cost the kernels' results
    bench-distill) run_stage bench-distill "$(bench bench_distill.py "$name.json" "not compiled")" ;;
    bench-compiled) run_stage bench-compiled "$(bench bench_distill.py "$name-compiled.json" compiled)" ;;
    bench-flat) run_stage bench-flat "$(bench bench_flat.py "$name-flat.json")" ;;
    # issue 5: the pfl-research shape (1000 clients x 50 CIFAR-sized images, 50 per round, batch 10,
    # simple_cnn), engine vs the sequential loop, and all 1000 clients in one round
    bench-engine) run_stage bench-engine "$(bench bench_engine.py "$name-engine.json")" ;;
    # issue 26: the engine (grouped cuDNN, implicit-GEMM and hybrid convolutions) against the plain per-client loop on the
    # five shapes, in one process; the convolution implementations alone; a profile of the pfl-research rounds
    bench-rounds) tiles=""; [ -s "$OUT_DIR/$name-tuned.txt" ] && tiles="--triton-configs @$OUT_DIR/$name-tuned.txt"
                  run_stage bench-rounds "python benchmarks/bench_rounds.py --device cuda --engine-conv grouped,triton,hybrid $tiles ${ROUNDS_ARGS:-} --out $OUT_DIR/$name-rounds.json" ;;
    # by default also the weight gradient without its reduction split (the 6th number: 1), against the automatic one
    bench-conv) run_stage bench-conv "python benchmarks/bench_conv.py --device cuda ${CONV_ARGS:---configs wgrad:64,64,32,8,2,1} --out $OUT_DIR/$name-conv.json" ;;
    # issue 45: the fused losses' and the aggregate's kernels one by one, their launch configurations swept
    probe) run_stage probe "python benchmarks/gpu_probe.py ${PROBE_ARGS:-} --out $OUT_DIR/$name-probe.json" ;;
    # issue 45: the host's side of a fused-loss step (per-launch costs, the path's own time, its ATen ops, cProfile)
    host-probe) run_stage host-probe "python benchmarks/host_probe.py ${HOST_ARGS:-} --out $OUT_DIR/$name-host.json" ;;
    bench-authors) run_stage bench-authors "python -m fedfast bench --device cuda ${AUTHORS_ARGS:-} --out $OUT_DIR/$name-authors.json" ;;
    profile) run_stage profile "python benchmarks/profile_round.py --device cuda --conv grouped,triton,hybrid ${PROFILE_ARGS:-} --out $OUT_DIR/$name-profile.txt" ;;
    *) echo "unknown stage $st (${ALL[*]})" | tee -a "$LOG"; failed+=("$st") ;;
  esac
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED stages: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "all stages passed: ${STAGES[*]}" | tee -a "$LOG"
echo "summary: python benchmarks/summarize.py $OUT_DIR/$name.json $OUT_DIR/$name-compiled.json" | tee -a "$LOG"
