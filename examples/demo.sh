#!/usr/bin/env bash
# The main job on a fresh machine: set up, bring up the local Slurm cluster, then
#   1. a 2-node MPI job writes one parallel HDF5 file through MPI-IO (and says where it is);
#   2. a 2-node data-parallel training job is preempted by an `urgent` job, checkpoints at the next
#      step boundary, requeues itself, resumes from the newest committed checkpoint, and ends with
#      the same parameter hash as an uninterrupted run of the same training.
set -euo pipefail
cd "$(dirname "$0")/.."
bash slurm/setup
slurm/devcluster up
PY=$PWD/.venv/bin/python
OUT=${COCI_DEMO_DIR:-$PWD/out/demo}
rm -rf "$OUT" && mkdir -p "$OUT"
wait_gone() { while [ -n "$(squeue -h -j "$1" 2>/dev/null)" ]; do sleep 1; done; sleep 1; }

job=$(sbatch --parsable -N 2 --ntasks-per-node=1 -o "$OUT/mpi-%j.out" \
  --wrap "srun --mpi=pmix $PY $PWD/examples/mpi_hdf5_hello.py $OUT/hello.h5")
echo "[demo] 1. submitted job $job (2 nodes, 2 MPI ranks, srun --mpi=pmix)"
wait_gone "$job"
cat "$OUT/mpi-$job.out"
state=$(sacct -X -n -P -j "$job" --format=State | tail -1)
echo "[demo] sacct says job $job: $state"
[ "$state" = COMPLETED ] || exit 1
echo "[demo] parallel HDF5 file written by 2 ranks on 2 nodes: $OUT/hello.h5"

STEPS=400
TRAIN="$PWD/examples/train_resumable.py --steps $STEPS --ckpt-every 100"
echo "[demo] 2. uninterrupted reference run (mpiexec -n 2)"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpiexec --allow-run-as-root --oversubscribe -n 2 \
  "$PY" -m mpi4py $TRAIN --ckpt-dir "$OUT/ckpt-ref" > "$OUT/reference.out"
ref=$(grep -o 'PARAM_HASH [0-9a-f]*' "$OUT/reference.out")
job=$(sbatch --parsable --time=10 -o "$OUT/train-%j.out" slurm/templates/train_preemptible.sbatch \
  "$PY" $TRAIN --ckpt-dir "$OUT/ckpt" --preemptible --signal-lead 60 --step-sleep 0.05)
echo "[demo] submitted preemptible training job $job to partition gpu"
until grep -q "saved step 100" "$OUT/train-$job.out" 2>/dev/null; do sleep 0.5; done
sleep 2
urgent=$(sbatch --parsable -p urgent -N 1 -o /dev/null --wrap "sleep 2")
echo "[demo] submitted urgent job $urgent: it preempts job $job"
wait_gone "$job"
cat "$OUT/train-$job.out"
sacct -X -D -P -j "$job" --format=JobID,State,Start,End,NodeList
got=$(grep -o 'PARAM_HASH [0-9a-f]*' "$OUT/train-$job.out")
echo "[demo] reference: $ref"
echo "[demo] preempted: $got"
[ "$ref" = "$got" ] || { echo "[demo] MISMATCH"; exit 1; }
"$PY" -m coci_hpc.cli.ckpt list "$OUT/ckpt"
echo "[demo] the preempted, requeued job ended bit-identical to the uninterrupted run; checkpoints in $OUT/ckpt"
