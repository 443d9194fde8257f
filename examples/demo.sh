#!/usr/bin/env bash
# The user's whole story on a fresh machine, through coci-submit:
#   set up, bring up the local Slurm cluster, then examples/train.py on 2 nodes of `gpu` is
#   1. preempted by an `urgent` job   -> stops at the next step boundary, saves, requeues itself;
#   2. loses a node, hard               -> its processes on n2 are SIGKILLed (devcluster fail --hard), the
#                                         survivor notices within seconds, saves the last finished step
#                                         and requeues; n2 is marked DOWN 10 s later; it resumes having
#                                         lost 0-1 steps;
#   3. runs out of time once           -> its limit is cut (scontrol update TimeLimit); warned
#                                         --signal-lead seconds before it, saves, requeues;
#   4. finishes.
# Then it prints the run's history (coci-status), checks the final parameters against an uninterrupted
# `mpiexec -n 2` run of the same seed, and writes the loss plot (PNG).
#
# Knobs (environment): COCI_DEMO_DIR (output, default out/demo), COCI_DEMO_STEPS (default 1500),
# COCI_DEVCLUSTER_DIR (the cluster's state directory). A cluster this script started is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash slurm/setup
was_up=0; slurm/devcluster status >/dev/null 2>&1 && was_up=1
slurm/devcluster up
eval "$(slurm/devcluster env)"
PY=$ROOT/.venv/bin/python
OUT=${COCI_DEMO_DIR:-$ROOT/out/demo}
STEPS=${COCI_DEMO_STEPS:-1500}
SEED=7
rm -rf "$OUT" && mkdir -p "$OUT"
say() { echo "[demo $(date +%H:%M:%S)] $*"; }
cleanup() {
  [ -n "${failed_node:-}" ] && slurm/devcluster recover "$failed_node" || true
  [ -n "${job:-}" ] && scancel "$job" 2>/dev/null || true
  [ "$was_up" = 1 ] || slurm/devcluster down >/dev/null 2>&1 || true
}
trap cleanup EXIT
# n-th event of a kind in the run's event log (the Session writes it; rank 0, one JSON line each)
count() { if [ -f "$OUT/ckpt/events.jsonl" ]; then grep -c "\"event\":\"$1\"" "$OUT/ckpt/events.jsonl" || true; else echo 0; fi; }
wait_for() {  # wait_for EVENT N WHAT: until the log has N records of EVENT
  local t=0
  until [ "$(count "$1")" -ge "$2" ]; do
    sleep 0.5; t=$((t + 1))
    [ "$t" -lt 600 ] || { say "timed out waiting for $3"; exit 1; }
  done
}

say "0. uninterrupted reference: mpiexec -n 2 python examples/train.py --steps $STEPS --seed $SEED"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpiexec --allow-run-as-root --oversubscribe -n 2 \
  "$PY" -m mpi4py examples/train.py --steps "$STEPS" --seed "$SEED" --policy fixed:50 --ckpt-dir "$OUT/ckpt-ref" \
  > "$OUT/reference.out"
ref=$(grep -o 'final_params_sha256=[0-9a-f]*' "$OUT/reference.out" | tail -1)
say "reference: $ref"

say "submitting: coci-submit --partition gpu --nodes 2 --time 10 --signal-lead 60 --policy fixed:50 examples/train.py ..."
"$ROOT/.venv/bin/coci-submit" --partition gpu --nodes 2 --time 10 --signal-lead 60 --policy fixed:50 \
  --job-name demo --output-dir "$OUT/run" --ckpt-dir "$OUT/ckpt" \
  examples/train.py --steps "$STEPS" --seed "$SEED" --step-time 0.05 | tee "$OUT/submit.out"
job=$(grep -o 'submitted job [0-9]*' "$OUT/submit.out" | grep -o '[0-9]*$')

# Spread the three interruptions over the run so that the loss plot shows each one apart.
wait_for checkpoint 4 "the fourth checkpoint"
say "1. an urgent job needs a node: Slurm preempts job $job"
sbatch -p urgent -N 1 -o /dev/null --wrap "sleep 2" >/dev/null
wait_for resumed 1 "the job to resume after the preemption"

ckpts=$(count checkpoint)
wait_for checkpoint $((ckpts + 4)) "four checkpoints in the second attempt"
sleep 1.5
failed_node=n2
say "2. node $failed_node fails hard under job $job (slurm/devcluster fail $failed_node --hard --delay 10)"
slurm/devcluster fail "$failed_node" --hard --delay 10 --reason "demo: node failure"
until [ "$(squeue -h -j "$job" -o %T)" = PENDING ]; do sleep 0.5; done
slurm/devcluster recover "$failed_node"
failed_node=
wait_for resumed 2 "the job to resume after the node failure"

sleep 8
# Cut this attempt's limit to 30-90 s from now: the --signal-lead warning (60 s) comes at once or soon.
run=$(scontrol show job -o "$job" | grep -o 'RunTime=[0-9:-]*' | cut -d= -f2)
secs=$(echo "$run" | awk -F: '{ print (NF == 3) ? $1 * 3600 + $2 * 60 + $3 : $1 * 60 + $2 }')
limit=$(( (secs + 30) / 60 + 1 ))
say "3. the attempt has run ${secs}s; its time limit is cut to ${limit} min (scontrol update TimeLimit=$limit)"
scontrol update jobid="$job" TimeLimit="$limit"
wait_for stop 2 "the time-limit stop"
scontrol update jobid="$job" TimeLimit=10   # the requeued attempt gets its 10 minutes back
wait_for resumed 3 "the job to resume after the time limit"

say "4. letting it finish"
while [ -n "$(squeue -h -j "$job" 2>/dev/null)" ]; do sleep 1; done
sleep 1
job_done=$job; job=
sacct -X -D -P -j "$job_done" --format=JobID,State,Start,End,NodeList,ExitCode

echo
"$ROOT/.venv/bin/coci-status" "$OUT/ckpt" --plot "$OUT/history.png"
echo
# The node failure's cost, from the event log: the attempt after it says how many steps it repeated.
"$PY" - "$OUT/ckpt" <<'PYEOF'
import sys
from coci_hpc.runtime.events import read_events
ev = read_events(sys.argv[1])
lost = [e for e in ev if e["event"] == "peer_lost"]
for s in ev:
    if s["event"] == "attempt_start" and (s.get("prev_end") or {}).get("reason") in ("rank_failure", "node_failure"):
        how = (f"survivors' checkpoint of step {lost[0]['step']}" if lost and lost[0].get("committed")
               else "no survivors' checkpoint: " + (lost[0]["reason"] if lost else "?"))
        print(f"[demo] node failure: {s.get('steps_lost')} steps lost (0-1 expected; {how}, resumed at step "
              f"{s.get('resumed_step')})")
PYEOF
got=$(grep -o 'final_params_sha256=[0-9a-f]*' "$OUT/run/logs/${job_done}_0_log.out" | tail -1)
say "reference:   $ref"
say "coci-submit: $got"
[ -n "$got" ] && [ "$ref" = "$got" ] || { say "MISMATCH"; exit 1; }
say "preempted, lost a node, hit its time limit once, and still ended bit-identical to the uninterrupted run"
say "loss plot: $OUT/history.png; logs: $OUT/run/logs; checkpoints: $OUT/ckpt"
