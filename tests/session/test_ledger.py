"""The steps-lost ledger is exact (issue 34): ``examples/train.py`` SIGKILLed at random steps, one
rank or all of them, inside a step or inside a save, then started again; the steps each restart
repeats (what the runs printed) are what the attempt line, ``events.jsonl`` and ``coci-status``
say, and the restart latency runs from the last step the killed run finished.

Before the progress records, a run killed after step 63 (checkpoint 50) said "2 step(s) to
repeat": the event log's losses lag a crash by up to 5 s. Each case below kills a run 5-90 steps
past a checkpoint with steps of 50 ms, so a ledger that lags would be caught.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env
from tests.faults.jobs import Job, job_pids, rank_of
from tests.session.ledger import kill_inside_a_step, steps_printed

TRAIN = str(ROOT / "examples" / "train.py")
ARGS = ["--steps", "140", "--policy", "fixed:25", "--step-time", "0.05"]
SAVE_PAUSE = {"COCI_FAULT_SAVE_PAUSE_S": "60", "COCI_FAULT_SAVE_PAUSE_RANK": "0"}


def launch(ranks: int, ckpt: Path, *, faulty: bool = False, env: dict[str, str] | None = None) -> Job:
    """examples/train.py as a plain process (``ranks`` 0) or under ``mpiexec -n ranks``; through
    tests/faults/faulty.py (the save-pause knob) when ``faulty``."""
    script = ["-m", "tests.faults.faulty", TRAIN] if faulty else [TRAIN]
    cmd = [sys.executable, *script, "--ckpt-dir", str(ckpt), *ARGS]
    if ranks:
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
               sys.executable, "-m", "mpi4py", *cmd[1:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=clean_env(OMP_NUM_THREADS="1", **(env or {})))
    job = Job(proc)

    def pump(stream, into: list[str], q: bool) -> None:
        for line in stream:
            into.append(line)
            if q:
                job.lines.put(line)
    job.readers = [threading.Thread(target=pump, args=(proc.stdout, job.out, True), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, job.err, False), daemon=True)]
    for t in job.readers:
        t.start()
    return job


def wait_step(job: Job, at_least: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= at_least for s in steps_printed("".join(job.out))):
            return
        assert job.proc.poll() is None, f"the run ended first:\n{''.join(job.out)[-1500:]}{''.join(job.err)[-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no step {at_least} in {timeout}s: {''.join(job.err)[-3000:]}")


def ranks_of(job: Job, n: int) -> list[int]:
    """The rank processes (a plain process is its own rank)."""
    if n == 0:
        return [job.proc.pid]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = sorted((p for p in job_pids(job.proc.pid) if rank_of(p) is not None), key=lambda p: rank_of(p) or 0)
        if len(pids) == n:
            return pids
        time.sleep(0.1)
    raise AssertionError("the ranks did not appear")


def killed(job: Job, pids: list[int], rng: random.Random) -> tuple[int, float]:
    """Kill ``pids`` inside a step; the last step the run printed, and when it was killed."""
    kill_inside_a_step(pids, rng)
    t_kill = time.time()
    try:
        job.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for p in job_pids(job.proc.pid):
            os.kill(p, 9)
        job.proc.wait(timeout=30)
    out, _ = job.output()
    return max(steps_printed(out)), t_kill


def check_restart(ckpt: Path, attempt: int, job: Job, last: int, t_kill: float, t_launch: float) -> int:
    """Attempt ``attempt`` (``job``, finished or still running) repeats ``last`` - its resumed step,
    and every record says so; returns that number."""
    start = [e for e in read_events(ckpt) if e["event"] == "attempt_start" and e["attempt"] == attempt][0]
    # None: nothing had committed yet (an asynchronous save of step 25 still being written when a
    # kill lands one or two steps later, as it did under CI's load); the run starts from step 1.
    resumed = start["resumed_step"] or 0
    out, err = "".join(job.out), "".join(job.err)
    assert steps_printed(out)[0] == resumed + 1, out[:300]            # it trains from there
    lost = last - resumed                                             # printed twice: repeated
    assert (start["steps_lost"], start["steps_lost_exact"], start["prev_last_step"]) == (lost, True, last), start
    if lost:
        assert f"; {lost} step(s) to repeat (the previous attempt finished step {last})" in err, err[-2000:]
    resumed_recs = [e for e in read_events(ckpt) if e["event"] == "resumed" and e["attempt"] == attempt]
    if start["resumed_step"] is None:
        # Nothing to resume from: the attempt starts afresh and writes no `resumed` record.
        assert not resumed_recs and "resumed from step" not in err, (resumed_recs, err[-2000:])
        return lost
    lat = resumed_recs[0]["restart_latency_s"]
    # From the last finished step (at most one 50 ms step before the kill) to the first resumed step.
    assert t_launch - t_kill <= lat["total"] <= time.time() - t_kill + 0.2, (lat, t_launch - t_kill)
    assert lat["after_last_step_s"] is not None and 0.0 <= lat["after_last_step_s"] < 1.0, lat
    assert "restart latency" in err and "from the last finished step" in err
    return lost


def status(ckpt: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "coci_hpc.cli.status", str(ckpt), "--json", "--no-sacct"],
                       capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.timeout(600)
def test_a_plain_process_killed_at_random_steps_and_inside_a_save_counts_the_steps_repeated(tmp_path: Path) -> None:
    rng = random.Random()
    ckpt = tmp_path / "ckpt"
    lasts: list[int] = []
    losts: list[int] = []
    t_kill = 0.0
    # 1: killed 1-74 steps past the first checkpoint (25); 2: killed again, 5-40 steps after it resumed
    for attempt, (lo, hi) in enumerate([(26, 100), (5, 40)], start=1):
        t_launch = time.time()
        job = launch(0, ckpt)
        if attempt > 1:
            wait_step(job, 1)
            resumed = steps_printed("".join(job.out))[0] - 1
            lo, hi = resumed + lo, min(resumed + hi, 135)
        wait_step(job, rng.randint(lo, hi))
        last, kill_wall = killed(job, [job.proc.pid], rng)
        if attempt > 1:
            losts.append(check_restart(ckpt, attempt, job, lasts[-1], t_kill, t_launch))
        lasts.append(last)
        t_kill = kill_wall
    # 3: killed inside a save (the injected pause holds it open): it resumes from the one before.
    t_launch = time.time()
    job = launch(0, ckpt, faulty=True, env=SAVE_PAUSE)
    deadline = time.monotonic() + 180
    while "FAULT INJECTION" not in "".join(job.err):
        assert job.proc.poll() is None and time.monotonic() < deadline, "".join(job.err)[-3000:]
        time.sleep(0.02)
    paused = int(re.search(r"pauses in the save of step_(\d+)", "".join(job.err)).group(1))
    time.sleep(rng.uniform(0.0, 1.0))
    last, kill_wall = killed(job, [job.proc.pid], rng)
    losts.append(check_restart(ckpt, 3, job, lasts[-1], t_kill, t_launch))
    lasts.append(last)
    t_kill = kill_wall
    # 4: runs to the end, from a checkpoint before the save that was killed
    t_launch = time.time()
    job = launch(0, ckpt)
    assert job.proc.wait(timeout=300) == 0, "".join(job.err)[-3000:]
    job.output()
    losts.append(check_restart(ckpt, 4, job, lasts[-1], t_kill, t_launch))
    start4 = [e for e in read_events(ckpt) if e["event"] == "attempt_start"][3]
    assert (start4["resumed_step"] or 0) < paused <= lasts[2], (start4, paused)
    # coci-status: the same numbers, and each killed attempt reached the step it printed last
    h = status(ckpt)
    assert [a["steps_lost"] for a in h["attempts"]] == [None, *losts], (h["attempts"], losts)
    assert h["steps_lost_total"] == sum(losts) and [a["last_step"] for a in h["attempts"][:3]] == lasts


@pytest.mark.timeout(600)
def test_two_ranks_one_killed_all_killed_and_killed_inside_a_save_count_the_steps_repeated(tmp_path: Path) -> None:
    """Under ``mpiexec -n 2``: rank 1 SIGKILLed inside a step (mpiexec then ends rank 0, which
    may first save what it can), then both ranks at once, then both while rank 1 is held inside a
    save (rank 0 waits for it in the save's collective); rank 0's output is the truth."""
    rng = random.Random()
    ckpt = tmp_path / "ckpt"
    lasts: list[int] = []
    losts: list[int] = []
    t_kill = 0.0
    for attempt, victims, in_save in ((1, [1], False), (2, [0, 1], False), (3, [0, 1], True), (4, [], False)):
        t_launch = time.time()
        job = launch(2, ckpt, faulty=in_save, env={**SAVE_PAUSE, "COCI_FAULT_SAVE_PAUSE_RANK": "1"} if in_save else None)
        wait_step(job, 1)
        if in_save:
            deadline = time.monotonic() + 180
            while "FAULT INJECTION" not in "".join(job.err):
                assert job.proc.poll() is None and time.monotonic() < deadline, "".join(job.err)[-3000:]
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.0))
        elif victims:
            resumed = steps_printed("".join(job.out))[0] - 1
            wait_step(job, rng.randint(max(resumed, 25) + 1, min(max(resumed, 25) + 60, 135)))
        if victims:
            pids = ranks_of(job, 2)
            last, kill_wall = killed(job, [pids[r] for r in victims], rng)
        else:
            assert job.proc.wait(timeout=300) == 0, "".join(job.err)[-3000:]
            job.output()
        if attempt > 1:
            losts.append(check_restart(ckpt, attempt, job, lasts[-1], t_kill, t_launch))
        if victims:
            lasts.append(last)
            t_kill = kill_wall
    print(lasts, losts, [e for e in read_events(ckpt) if e["event"] in ("peer_lost", "stop", "end")])
    h = status(ckpt)
    assert [a["steps_lost"] for a in h["attempts"]] == [None, *losts], (h["attempts"], losts)
    assert [a["last_step"] for a in h["attempts"][:3]] == lasts
