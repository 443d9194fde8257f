#!/usr/bin/env bash
# The main job on a fresh machine: set up, bring up the local Slurm cluster, run a 2-node MPI job
# that writes one parallel HDF5 file through MPI-IO, and say where it is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash slurm/setup
slurm/devcluster up
OUT=${COCI_DEMO_DIR:-$PWD/out/demo}
mkdir -p "$OUT"
job=$(sbatch --parsable -N 2 --ntasks-per-node=1 -o "$OUT/mpi-%j.out" \
  --wrap "srun --mpi=pmix $PWD/.venv/bin/python $PWD/examples/mpi_hdf5_hello.py $OUT/hello.h5")
echo "[demo] submitted job $job (2 nodes, 2 MPI ranks, srun --mpi=pmix)"
while [ -n "$(squeue -h -j "$job" 2>/dev/null)" ]; do sleep 1; done
sleep 1
cat "$OUT/mpi-$job.out"
state=$(sacct -X -n -P -j "$job" --format=State | tail -1)
echo "[demo] sacct says job $job: $state"
[ "$state" = COMPLETED ] || exit 1
echo "[demo] parallel HDF5 file written by 2 ranks on 2 nodes: $OUT/hello.h5"
