"""Restart latency in place (coci-submit --spare-nodes) against the queue, side by side, on the local cluster.

    COCI_DEVCLUSTER_DIR=/work/devcluster flock /tmp/coci-cluster.lock \\
        .venv/bin/python benchmarks/relaunch_bench.py                 # 5 failures in place, 2 through the queue
    ... benchmarks/relaunch_bench.py --failures 3 --queue-failures 1  # shorter

Switches the local cluster (slurm/devcluster) to 3 nodes and back to 2 at the end, whatever
happens. Two jobs of examples/train.py (2 nodes x 1 rank, ``fixed:50``, 0.05 s steps):

- **in place**: ``--nodes 2 --spare-nodes 1``; --failures failures at random steps, each once the
  previous restart trains again, always of rank 1's node (never n1, which holds the batch script):
  crashes (every job process on it SIGKILLed, ``devcluster kill-tasks``; the loop restarts on the
  spare, the crashed node becoming the spare) and, last, a hard failure of it (``devcluster fail
  NODE --hard --delay 1``: killed, marked DOWN a second later), which moves the ranks to the spare;
- **queue**: the same training without spare nodes; --queue-failures crashes of n2, each requeued
  through Slurm's queue by the survivors (the way every restart went before spare nodes).

Latency = failure (this script's clock, just before the kill) -> the restarted attempt's first
resumed step (its ``resumed`` record). For the in-place restarts, ``coci-status``'s split of each
(:func:`coci_hpc.history.in_place_split`: detect, decide, relaunch, start, restore) is printed
too; its ``detect`` starts when a survivor saw the failure, so failure -> that moment is the rest.
Both jobs' final ``final_params_sha256`` must equal an uninterrupted ``mpiexec -n 2`` run's.
Prints JSON, then a table; the ratio is the queue's median latency over the in-place median.
"""
from __future__ import annotations

import argparse
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coci_hpc import history  # noqa: E402
from coci_hpc.runtime.events import read_events  # noqa: E402

DEVCLUSTER = ROOT / "slurm" / "devcluster"
TRAIN = ROOT / "examples" / "train.py"
HASH_RE = re.compile(r"final_params_sha256=([0-9a-f]{64})")
EVERY, SEED, STEP_TIME = 50, 5, 0.05


class Cluster:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        out = subprocess.run([str(DEVCLUSTER), "env"], capture_output=True, text=True).stdout.strip()
        if out:                                      # "export SLURM_CONF=..."
            key, _, value = out.split(None, 1)[1].partition("=")
            self.env[key] = value

    def run(self, *cmd: str, check: bool = True, timeout: float = 300) -> str:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr}{p.stdout}")
        return p.stdout

    def dc(self, *args: str, check: bool = True) -> str:
        return self.run(str(DEVCLUSTER), *args, check=check)

    def gone(self, job: str) -> bool:
        return not self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()


def _wait(pred: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _resumed(ckpt: Path, attempt: int) -> dict | None:
    return next((e for e in read_events(ckpt) if e["event"] == "resumed" and e["attempt"] == attempt), None)


def submit(cluster: Cluster, wd: Path, ckpt: Path, steps: int, *extra: str) -> str:
    env = {**cluster.env, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "coci_hpc.cli.submit", "--partition", "gpu", "--time", "15",
                        "--signal-lead", "60", "--output-dir", str(wd / "run"), "--nodes", "2", *extra,
                        "--ckpt-dir", str(ckpt), "--policy", f"fixed:{EVERY}", str(TRAIN), "--steps", str(steps),
                        "--seed", str(SEED), "--step-time", str(STEP_TIME)],
                       capture_output=True, text=True, env=env, cwd=wd, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(p.stdout + p.stderr)
    return re.search(r"submitted job (\d+)", p.stdout).group(1)  # type: ignore[union-attr]


def inject(cluster: Cluster, ckpt: Path, kinds: list[str], resume_timeout: float) -> list[dict]:
    """Each failure once the previous attempt trains; returns failure wall and resumed wall."""
    out = []
    _wait(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 300)
    for i, kind in enumerate(kinds):
        time.sleep(random.uniform(0.5, 2.5))          # a random step
        # Rank 1's node: never the first one, which holds the batch script (the relaunch loop).
        node = [e for e in read_events(ckpt) if e["event"] == "attempt_start"][-1]["nodes"][-1]
        t = time.time()
        if kind == "node":
            cluster.dc("fail", node, "--hard", "--delay", "1")
        else:
            cluster.dc("kill-tasks", node)
        _wait(lambda: _resumed(ckpt, i + 2) is not None, f"the restart after failure {i + 1}", resume_timeout)
        res = _resumed(ckpt, i + 2)
        assert res is not None
        out.append({"kind": kind, "failure_wall": t, "resumed_wall": res["wall"], "latency_s": res["wall"] - t})
        print(f"  {kind}: resumed {res['wall'] - t:.2f}s after the failure (step {res['step']})", file=sys.stderr)
    return out


def final_hash(wd: Path, job: str) -> str | None:
    found = HASH_RE.findall((wd / "run" / "logs" / f"{job}_0_log.out").read_text())
    return found[-1] if found else None



def reference_hash(steps: int, ckpt: Path) -> str:
    """Final parameter hash of the same training run uninterrupted (mpiexec -n 2)."""
    ref = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                          "-m", "mpi4py", str(TRAIN), "--steps", str(steps), "--seed", str(SEED),
                          "--policy", f"fixed:{EVERY}", "--ckpt-dir", str(ckpt)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return HASH_RE.findall(ref.stdout)[-1]

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--failures", type=int, default=5, help="failures restarted in place (the last one a node)")
    ap.add_argument("--queue-failures", type=int, default=2, help="crashes restarted through the queue")
    ap.add_argument("--seed", type=int, default=0, help="seed of the failure times")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args(argv)
    random.seed(a.seed)
    cluster = Cluster()
    wd = Path(tempfile.mkdtemp(prefix="relaunch-bench-"))
    load = os.getloadavg()
    result: dict = {"benchmark": "relaunch", "load_avg_1_5_15": [round(x, 2) for x in load],
                    "step_time_s": STEP_TIME, "policy": f"fixed:{EVERY}"}
    steps_in = 300 + 120 * a.failures
    steps_q = 300 + 120 * a.queue_failures
    try:
        cluster.dc("down")
        cluster.dc("up", "--nodes", "3")
        ref_in = reference_hash(steps_in, wd / "ref")
        ref_queue = reference_hash(steps_q, wd / "ref-q")

        print(f"in place: {a.failures} failure(s)", file=sys.stderr)
        wd_in = wd / "inplace"
        wd_in.mkdir()
        ckpt_in = wd_in / "ckpt"
        kinds = ["crash"] * (a.failures - 1) + ["node"] if a.failures else []
        job = submit(cluster, wd_in, ckpt_in, steps_in, "--spare-nodes", "1", "--max-restarts", str(a.failures + 1))
        try:
            inplace = inject(cluster, ckpt_in, kinds, 120)
            _wait(lambda: cluster.gone(job), "the in-place job's end", 600)
        finally:
            for n in ("n2", "n3"):
                cluster.dc("recover", n, check=False)
        h = history.load(ckpt_in, use_sacct=False)
        for row, att in zip(inplace, [x for x in h.attempts if x.in_place]):
            row["split"] = {k: att.in_place[k] for k in ("detect_s", "decide_s", "relaunch_s", "process_start_s",
                                                          "restore_s", "total_s")} if att.in_place else None
        result["in_place"] = {"job": job, "failures": inplace, "bit_exact": final_hash(wd_in, job) == ref_in,
                              "steps_lost": [x.steps_lost for x in h.attempts[1:]]}

        print(f"queue: {a.queue_failures} failure(s)", file=sys.stderr)
        wd_q = wd / "queue"
        wd_q.mkdir()
        ckpt_q = wd_q / "ckpt"
        job_q = submit(cluster, wd_q, ckpt_q, steps_q)
        queue = inject(cluster, ckpt_q, ["crash"] * a.queue_failures, 240)
        _wait(lambda: cluster.gone(job_q), "the queued job's end", 600)
        result["queue"] = {"job": job_q, "failures": queue, "bit_exact": final_hash(wd_q, job_q) == ref_queue}
    finally:
        cluster.dc("down", check=False)
        cluster.dc("up", "--nodes", "2", check=False)
        if not a.keep:
            shutil.rmtree(wd, ignore_errors=True)
        else:
            print(f"kept {wd}", file=sys.stderr)
    lat_in = [f["latency_s"] for f in result["in_place"]["failures"]]
    lat_q = [f["latency_s"] for f in result["queue"]["failures"]]
    result["summary"] = {
        "in_place_s": {"n": len(lat_in), "median": statistics.median(lat_in), "mean": statistics.fmean(lat_in),
                       "max": max(lat_in), "min": min(lat_in)},
        "queue_s": {"n": len(lat_q), "median": statistics.median(lat_q), "mean": statistics.fmean(lat_q)},
        "queue_over_in_place": statistics.median(lat_q) / statistics.median(lat_in),
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result, indent=1))
    print(f"\n{'restart':<16} {'failure -> resumed s':>20}   coci-status split (detect + decide + relaunch + start + restore)")
    for f in result["in_place"]["failures"]:
        s = f.get("split") or {}
        parts = " + ".join("-" if s.get(k) is None else f"{s[k]:.1f}"
                           for k in ("detect_s", "decide_s", "relaunch_s", "process_start_s", "restore_s"))
        print(f"{'in place, ' + f['kind']:<16} {f['latency_s']:>20.2f}   {parts}")
    for f in result["queue"]["failures"]:
        print(f"{'queue, ' + f['kind']:<16} {f['latency_s']:>20.2f}")
    sm = result["summary"]
    print(f"\nin place: median {sm['in_place_s']['median']:.2f}s, max {sm['in_place_s']['max']:.2f}s over "
          f"{sm['in_place_s']['n']}; queue: median {sm['queue_s']['median']:.2f}s over {sm['queue_s']['n']}; "
          f"queue / in place = {sm['queue_over_in_place']:.1f}x; bit-exact: in place "
          f"{result['in_place']['bit_exact']}, queue {result['queue']['bit_exact']}; load {result['load_avg_1_5_15']}")
    return 0 if result["in_place"]["bit_exact"] and result["queue"]["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
