"""A peer lost while a synchronous save is inside collective MPI-IO (issue 13): the survivor's
main thread is blocked in a call that cannot be polled, and the guard's timer (``Comm.guard``)
starts the survivors' save from its thread. Two real MPI ranks under a Session, no cluster:
rank 1 stalls just before the final save's MPI-IO (the test-only faulty writer of
tests/faults/faulty.py, COCI_FAULT_SAVE_PAUSE_AT=mpiio), which to rank 0 is the same as a peer killed there (its
collective never completes). Rank 0 must commit the survivors' checkpoint of the last step within
seconds, with rank 1's per-rank state from its partner copy."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env

FAULTY = ("-m", "tests.faults.faulty")   # installs the faulty writer the environment asks for

SCRIPT = r'''
import sys, torch
import coci_hpc
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.comm import Comm
comm = Comm.world()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# The same data on every rank (no DDP here to average the gradients): the model and the optimizer
# are replicated state and must stay equal, or the store refuses to mix the ranks' copies.
torch.manual_seed(10)
sampler = ResumableSampler(64, seed=1, rank=comm.rank, world_size=comm.size)
s = coci_hpc.Session({"model": model, "optimizer": opt, "loader": sampler}, total_steps=12,
                     ckpt_dir=sys.argv[1], policy="fixed:1000", environ={}, comm=comm, peer_timeout_s=3.0)
for step in s.steps():
    sampler.next_batch(4)          # per-rank state that moves, as a real loader's does
    loss = model(torch.randn(4, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    s.observe(loss.detach())
print("finished", comm.rank, flush=True)
'''


def test_a_peer_lost_inside_mpiio_is_noticed_by_the_guard_and_the_survivor_saves(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = clean_env(COCI_FAULT_SAVE_PAUSE_S="10", COCI_FAULT_SAVE_PAUSE_AT="mpiio")
    t0 = time.monotonic()
    # The survivor leaves with os._exit (no MPI_Finalize with a lost peer): mpiexec reports it.
    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *FAULTY,
                        str(script), str(ckpt)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    lost = [e for e in read_events(ckpt) if e["event"] == "peer_lost"]
    assert lost, out
    rec = lost[0]
    assert rec["survivor"] == 0 and rec["committed"] and rec["step"] == 12, (rec, out)
    assert "is stuck" in rec["how"] and "did not return within" in rec["how"], rec
    assert rec["commit_wall"] - rec["failure_wall"] < 10.0, rec
    assert rec["lost_ranks"] == [1]
    assert cat.latest_step(ckpt) == 12                       # the survivors' checkpoint of the last step
    assert "finished 0" not in out                          # rank 0 never got past the stuck save
    # Open MPI's "failed to TCP connect" warning after a lost peer is explained beside coci's line
    assert re.search(r"rank 0: peer lost at step \d+: .*Open MPI may now warn .*expected after a lost peer", out), out
    print(rec, f"{time.monotonic() - t0:.1f}s")


def test_a_process_left_behind_by_a_newer_attempt_neither_saves_nor_records(tmp_path: Path) -> None:
    """A host that stopped past SlurmdTimeout and ran again: its ranks belong to an attempt Slurm
    has replaced (requeued, started elsewhere). Here attempt 2's ``attempt_start`` is written while
    attempt 1 runs, then attempt 1 loses its peer as above: rank 0 must leave without a survivors'
    checkpoint, a ``peer_lost`` record or a requeue, which would act on the live attempt."""
    from coci_hpc.runtime.events import FILENAME, EventLog

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = clean_env(COCI_FAULT_SAVE_PAUSE_S="10", COCI_FAULT_SAVE_PAUSE_AT="mpiio")
    p = subprocess.Popen(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *FAULTY,
                          str(script), str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "attempt_start" for e in read_events(ckpt)):
            assert time.monotonic() < deadline and p.poll() is None, "attempt 1 never started"
            time.sleep(0.02)
        EventLog(ckpt / FILENAME, attempt=2, job_id=None).write("attempt_start", nodes=["elsewhere"], ranks=2)
        out = p.communicate(timeout=120)[0]
    finally:
        p.kill()
    events = read_events(ckpt)
    assert [e["event"] for e in events if e["event"] != "losses"] == ["attempt_start", "attempt_start"], (events, out)
    assert "attempt 2 of this run has started since this attempt (1) began" in out, out
    assert "finished 0" not in out and cat.latest_step(ckpt) is None, out    # nothing saved
