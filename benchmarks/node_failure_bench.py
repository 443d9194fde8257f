"""What a hard node failure costs, with and without the survivors' save (issue 13), on the local cluster.

    export COCI_DEVCLUSTER_DIR=/work/devcluster      # or leave unset: <checkout>/.devcluster
    python benchmarks/node_failure_bench.py --failures 10 --per-job 5   # JSON + table
    python benchmarks/node_failure_bench.py --failures 2 --modes on     # a quick look

Each job (``coci-submit --nodes 2 --policy fixed:EVERY examples/train.py``) is failed --per-job
times: whenever its current attempt has done a random number of steps (uniform in [--min-step,
--max-step]) past the step it resumed from, ``slurm/devcluster fail NODE --hard --delay D``
SIGKILLs the job's processes on rank 1's node and marks that node DOWN D seconds later (D stands for
SlurmdTimeout); the job is requeued (by the survivors, or by Slurm for NODE_FAIL), the node is
recovered, and once the requeued attempt has resumed (its ``resumed`` record) the next failure
follows; after the last one the job is cancelled. The modes alternate job by job (on, off, on, ...)
so that load from other users of the machine hits both alike; "off" is the same run with
``COCI_SURVIVORS=0`` (it falls back to the last regular checkpoint, every EVERY steps).

The memory tier (issue 25) has its own pair of modes, run on ``examples/train_fsdp.py`` (FSDP2: a
lost rank's shards exist nowhere else, so only the memory tier can save them):

    python benchmarks/node_failure_bench.py --modes memtier,nomemtier --failures 6 --per-job 3

"memtier" copies each rank's state to its partner every ``--memtier-k`` steps (``COCI_MEMTIER_K``;
the goal is at most k steps lost per failure), "nomemtier" is the same run with ``COCI_MEMTIER_K=0``
(the survivors cannot save a lost rank's shards: the disk tier serves). ``tier`` in each row is
which tier served (the ``peer_lost`` record).

Per failure, from the run's event log (``events.jsonl``) and sacct:
- steps lost: the requeued attempt's ``steps_lost`` (steps done before the failure and done again);
- failure -> commit: from the kill to the survivors' manifest (``peer_lost.commit_wall``);
- restart latency: from the kill to the first resumed step, split into failure -> requeued
  attempt's start (detect + save + Slurm noticing the node + requeue + scheduling; sacct's Start,
  1 s resolution), process start (-> Session created) and restore (the session's own figures).
The cluster lock (``/tmp/coci-cluster.lock``, --lock) is held per job and released between jobs,
so that others can use the cluster while this runs.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coci_hpc.runtime.events import read_events  # noqa: E402
from coci_hpc.slurm.hostlist import expand_hostlist  # noqa: E402

DEVCLUSTER = ROOT / "slurm" / "devcluster"
TRAIN = ROOT / "examples" / "train.py"
TRAIN_FSDP = ROOT / "examples" / "train_fsdp.py"
MODES = ("on", "off", "memtier", "nomemtier")


def mode_env(mode: str, memtier_k: int) -> dict[str, str]:
    """The environment of a mode (see the module docstring)."""
    return {"on": {"COCI_SURVIVORS": "1"}, "off": {"COCI_SURVIVORS": "0"},
            "memtier": {"COCI_SURVIVORS": "1", "COCI_MEMTIER_K": str(memtier_k)},
            "nomemtier": {"COCI_SURVIVORS": "1", "COCI_MEMTIER_K": "0"}}[mode]
STEP_RE = re.compile(r"^step=(\d+) ", re.M)


class BenchError(RuntimeError):
    pass


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    line = subprocess.run([str(DEVCLUSTER), "env"], capture_output=True, text=True, check=True).stdout.strip()
    key, value = line.split(None, 1)[1].split("=", 1)        # export SLURM_CONF=...
    env[key] = value
    env["PYTHONPATH"] = str(ROOT)
    return env


@contextmanager
def cluster_lock(path: str) -> Iterator[None]:
    """The shared cluster's lock; inside it, the cluster is up (started if it is not; a cluster
    someone else started, with its node count, is left as it is)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if subprocess.run([str(DEVCLUSTER), "status"], capture_output=True).returncode != 0:
                up = subprocess.run([str(DEVCLUSTER), "up"], capture_output=True, text=True, timeout=300)
                if up.returncode != 0:
                    raise BenchError(f"slurm/devcluster up failed: {up.stderr}{up.stdout}")
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sh(env: dict[str, str], *cmd: str, check: bool = True, timeout: float = 120) -> str:
    p = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    if check and p.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr}{p.stdout}")
    return p.stdout


def wait(pred: Any, what: str, timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")


def sacct_starts(env: dict[str, str], job: str) -> list[tuple[str, float | None]]:
    out = sh(env, "sacct", "-X", "-D", "-P", "-n", "-j", job, "--format=State,Start")
    rows = []
    for line in out.strip().splitlines():
        state, start = line.split("|")
        t = None
        if start and start not in ("Unknown", "None"):
            t = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
        rows.append((state, t))
    return rows


def one_job(env: dict[str, str], wd: Path, a: argparse.Namespace, mode: str,
            offsets: list[int]) -> list[dict[str, Any]]:
    """One job, failed hard once per entry of ``offsets``: each time its current attempt has done
    that many steps past the step it resumed from (the attempts append to one log)."""
    ckpt, run = wd / "ckpt", wd / "run"
    jenv = {**env, **mode_env(mode, a.memtier_k)}
    survivors = mode != "off"
    train = TRAIN_FSDP if mode in ("memtier", "nomemtier") else TRAIN
    out = sh(jenv, sys.executable, "-m", "coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2",
             "--time", "60", "--job-name", "nfbench", "--output-dir", str(run), "--ckpt-dir", str(ckpt),
             "--policy", f"fixed:{a.every}", "--max-requeues", str(len(offsets) + 5), str(train),
             "--steps", str(a.steps), "--seed", "3", "--step-time", str(a.step_time))
    m = re.search(r"submitted job (\d+)", out)
    if m is None:
        raise BenchError(f"coci-submit printed no job id: {out}")
    job = m.group(1)
    log0 = run / "logs" / f"{job}_0_log.out"
    kills: list[tuple[float, int, int]] = []        # (wall, target step, last step printed)
    down: str | None = None
    try:
        pos, base = 0, 0
        for k, offset in enumerate(offsets):
            target = base + offset

            def reached(pos: int = pos, target: int = target) -> bool:
                steps = STEP_RE.findall(log0.read_text()[pos:]) if log0.exists() else []
                return bool(steps) and int(steps[-1]) >= target
            wait(reached, f"job {job} to reach step {target}", 300)
            nodes = expand_hostlist(sh(env, "squeue", "-h", "-j", job, "-o", "%N").strip())
            down = nodes[-1]                         # rank 1's node (one rank per node)
            kills.append((time.time(), target, int(STEP_RE.findall(log0.read_text()[pos:])[-1])))
            sh(env, str(DEVCLUSTER), "fail", down, "--hard", "--delay", str(a.delay),
               "--reason", "node_failure_bench", timeout=a.delay + 60)
            wait(lambda: sh(env, "squeue", "-h", "-j", job, "-o", "%T", check=False).strip() == "PENDING",
                 f"job {job} to be requeued", 120, every=0.5)
            sh(env, str(DEVCLUSTER), "recover", down)
            down = None

            def resumed(k: int = k) -> list[dict[str, Any]]:
                return [e for e in read_events(ckpt) if e.get("event") == "resumed" and e.get("attempt") == k + 2]
            res = wait(resumed, f"job {job} to resume", 300, every=0.5)
            pos = len(log0.read_text())
            base = int(res[0].get("step") or 0)
    finally:
        sh(env, "scancel", job, check=False)
        if down is not None:
            sh(env, str(DEVCLUSTER), "recover", down, check=False)
        wait(lambda: not sh(env, "squeue", "-h", "-j", job, check=False).strip(), f"job {job} to leave", 120, 0.5)
    events = read_events(ckpt)
    rows = sacct_starts(env, job)
    out_rows = []
    for k, (t_kill, target, printed) in enumerate(kills):
        def of(kind: str, attempt: int) -> dict[str, Any]:
            return next((e for e in events if e.get("event") == kind and e.get("attempt") == attempt), {})
        start, res, pl = of("attempt_start", k + 2), of("resumed", k + 2), of("peer_lost", k + 1)
        lat = res.get("restart_latency_s") or {}
        nxt = rows[k + 1][1] if len(rows) > k + 1 else None
        out_rows.append({
            "mode": mode, "survivors": survivors, "job": job, "tier": pl.get("tier"), "failure": k + 1, "fail_at_step": target,
            "last_step_printed": printed, "resumed_step": start.get("resumed_step"),
            "steps_lost": start.get("steps_lost"), "prev_end": (start.get("prev_end") or {}).get("reason"),
            "survivors_committed": bool(pl.get("committed")), "survivors_reason": pl.get("reason"),
            "failure_to_commit_s": (pl["commit_wall"] - t_kill) if pl.get("commit_wall") else None,
            "failure_to_requeued_start_s": (nxt - t_kill) if nxt else None,
            "process_start_s": lat.get("process_start_s"), "restore_s": lat.get("restore_s"),
            "failure_to_resumed_s": (float(res["wall"]) - t_kill) if res.get("wall") else None,
            "sacct": rows[k][0] if len(rows) > k else None,
        })
    return out_rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    for r in rows:
        # The session's steps_lost comes from the ranks' progress records (exact; before issue 34 a
        # lower bound from the event log); the last step rank 0 printed before the kill cross-checks it.
        seen = [x for x in (r.get("steps_lost"),
                            None if r.get("resumed_step") is None or r.get("last_step_printed") is None
                            else r["last_step_printed"] - r["resumed_step"]) if x is not None]
        r["steps_lost_max_bound"] = max(0, *seen) if seen else None
    def stats(key: str) -> dict[str, float | None]:
        xs = [float(r[key]) for r in rows if r.get(key) is not None]
        return {"mean": statistics.fmean(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}
    tiers: dict[str, int] = {}
    for r in rows:
        tiers[str(r.get("tier"))] = tiers.get(str(r.get("tier")), 0) + 1
    return {"failures": len(rows), "committed": sum(r["survivors_committed"] for r in rows), "tiers": tiers,
            **{k: stats(k) for k in ("steps_lost", "steps_lost_max_bound", "failure_to_commit_s", "failure_to_requeued_start_s",
                                     "process_start_s", "restore_s", "failure_to_resumed_s")}}


def table(summary: dict[str, dict[str, Any]]) -> str:
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"{'mode':<10} {'fails':>5} {'saved':>5} {'lost mean':>9} {'lost max':>8} "
             f"{'lost* mean':>10} {'lost* max':>9} {'->commit s':>10} {'->start s':>9} {'proc s':>6} {'restore s':>9} {'->resumed s':>11}"]
    for mode, s in summary.items():
        lines.append(f"{mode:<10} {s['failures']:>5} {s['committed']:>5} {f(s['steps_lost']['mean']):>9} "
                     f"{f(s['steps_lost']['max'], 0):>8} {f(s['steps_lost_max_bound']['mean']):>10} "
                     f"{f(s['steps_lost_max_bound']['max'], 0):>9} {f(s['failure_to_commit_s']['mean']):>10} "
                     f"{f(s['failure_to_requeued_start_s']['mean']):>9} {f(s['process_start_s']['mean']):>6} "
                     f"{f(s['restore_s']['mean'], 2):>9} {f(s['failure_to_resumed_s']['mean']):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--failures", type=int, default=10, help="hard failures per mode")
    ap.add_argument("--modes", default="on,off", help="comma-separated, of: survivors' save on, off "
                    "(COCI_SURVIVORS=0), memtier, nomemtier (FSDP2 with / without the memory tier)")
    ap.add_argument("--memtier-k", type=int, default=5, help="memtier mode: copy to the partner every k steps")
    ap.add_argument("--per-job", type=int, default=5, help="failures per job (the lock is held per job)")
    ap.add_argument("--steps", type=int, default=3000, help="the job's total steps (it is cancelled after "
                                                            "its last failure's resume)")
    ap.add_argument("--every", type=int, default=50, help="regular checkpoint every N steps (fixed:N)")
    ap.add_argument("--step-time", type=float, default=0.03)
    ap.add_argument("--min-step", type=int, default=60, help="fail this many steps past the resumed step, at least")
    ap.add_argument("--max-step", type=int, default=160, help="... and at most")
    ap.add_argument("--delay", type=float, default=10.0, help="kill -> node DOWN (stands for SlurmdTimeout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock", default="/tmp/coci-cluster.lock")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--summarize", default=None, metavar="JSON", help="print the table of an earlier --json")
    a = ap.parse_args(argv)
    if a.summarize:
        done = json.loads(Path(a.summarize).read_text())
        summary = {m: summarize(rs) for m, rs in done["runs"].items()}
        print(json.dumps(summary, indent=1))
        print(table(summary))
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: each of {', '.join(MODES)}; got {a.modes!r}")
    rnd = random.Random(a.seed)
    base = Path(tempfile.mkdtemp(prefix="nfbench-", dir=os.environ.get("TMPDIR")))
    env = cluster_env()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    errors: list[dict[str, Any]] = []
    jobs = -(-a.failures // a.per_job)
    for i in range(jobs):
        for mode in modes:
            offsets = [rnd.randint(a.min_step, a.max_step) for _ in range(min(a.per_job, a.failures - i * a.per_job))]
            try:
                with cluster_lock(a.lock):
                    got = one_job(env, base / f"{mode}-{i}", a, mode, offsets)
            except BenchError as exc:       # e.g. the cluster busy with someone else's job: skip, say so
                errors.append({"mode": mode, "job": i, "error": str(exc)})
                print(f"job {mode}-{i} skipped: {exc}", file=sys.stderr, flush=True)
                continue
            rows[mode].extend(got)
            for r in got:
                print(json.dumps(r), file=sys.stderr, flush=True)
    summary = {m: summarize(rs) for m, rs in rows.items()}
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    result = {"bench": "node_failure", "args": vars(a), "loadavg": load, "summary": summary, "runs": rows,
              "skipped": errors}
    print(json.dumps(result, indent=1))
    print(table(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
