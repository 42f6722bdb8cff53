#!/bin/bash
# A study as a Slurm job array: task I of N runs the I-th of N disjoint parts of the study's runs.
#
#   sbatch --array=0-3 examples/slurm/sweep-array.sh examples/study/fedlc-mnist.toml studies/fedlc
#
# Extra arguments after the two go to `fedfast sweep` (e.g. --set rounds=50). A requeued task, a task run twice
# or a second submission of the array skips finished runs and resumes interrupted ones; the run directories'
# locks keep two tasks from ever running one run (the study directory must be on a filesystem all nodes share).
# `fedfast report studies/fedlc` writes the table once the array is done (sbatch --dependency=afterany:JOBID).
#SBATCH --job-name=fedfast-sweep
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=04:00:00
#SBATCH --output=fedfast-sweep-%A_%a.out
set -euo pipefail
study=${1:?usage: sbatch --array=0-N examples/slurm/sweep-array.sh STUDY.toml OUT_DIR [fedfast sweep options]}
out=${2:?usage: sbatch --array=0-N examples/slurm/sweep-array.sh STUDY.toml OUT_DIR [fedfast sweep options]}
shift 2
task=${SLURM_ARRAY_TASK_ID:?not a Slurm array task (submit with sbatch --array=0-N)}
count=${SLURM_ARRAY_TASK_COUNT:?not a Slurm array task (submit with sbatch --array=0-N)}
# the first array index may be other than 0 (--array=1-4): shards count from it
first=${SLURM_ARRAY_TASK_MIN:-0}
exec ${FEDFAST:-fedfast} sweep "$study" --out "$out" --shard "$((task - first))/$count" "$@"
