"""The failure history a job plans with (issue 12, item 9): not asked outside a job, cached per
partition and window for a day (shared by attempts and array tasks), read in the background while
the attempt starts with the cached or default model, and said to be partial under PrivateData=jobs.
Slurm's output is the captured real output in tests/fixtures/slurm/."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from coci_hpc.planner.failures import from_mtbf
from coci_hpc.slurm import failure_cache as fc
from coci_hpc.slurm.env import JobEnvironment

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"
CONFIG = (FIX / "scontrol_show_config.txt").read_text()
DEFAULT = from_mtbf(70 * 3600)
JOB = JobEnvironment(job_id="41", partition="gpu")


class FakeSlurm:
    """Answers with the captured real outputs; blocks sacct until released (a slow accounting)."""

    def __init__(self, config: str = CONFIG) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        self.config = config

    def __call__(self, argv) -> str:
        self.calls.append(argv[0])
        if argv[0] == "sacct":
            assert self.release.wait(60)
            return (FIX / "real_sacct.txt").read_text()
        if argv[0] == "sacctmgr":
            return (FIX / "real_events.txt").read_text()
        if argv[0] == "sinfo":
            return "n1\nn2\nn3\n"
        if argv[:3] == ["scontrol", "show", "config"]:
            return self.config
        raise AssertionError(argv)


def test_a_local_run_asks_nothing(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    for job in (JobEnvironment(), JobEnvironment(job_id="41")):      # no job; a job without partition
        model, line, pending = fc.failure_model_for_job(job, DEFAULT, window_days=90, runner=slurm,
                                                        environ={"XDG_CACHE_HOME": str(tmp_path)})
        assert model is DEFAULT and pending is None and "no cluster history asked" in line
    assert slurm.calls == []


def test_read_in_the_background_then_cached_for_every_attempt_and_array_task(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    slurm = FakeSlurm()
    t0 = time.monotonic()
    model, line, pending = fc.failure_model_for_job(JOB, DEFAULT, window_days=90, runner=slurm, environ=env)
    # The attempt starts at once, with the default model, while sacct has not even answered.
    assert time.monotonic() - t0 < 5 and model is DEFAULT and pending is not None and not pending.done()
    assert "reading it in the background" in line
    # A second task starting meanwhile does not ask again.
    m2, line2, p2 = fc.failure_model_for_job(JOB, DEFAULT, window_days=90, runner=slurm, environ=env)
    assert p2 is None and m2 is DEFAULT and "being read by another process" in line2
    slurm.release.set()
    pending.join(30)
    got = pending.result()
    assert got is not None and got[0].n_failures >= 1 and got[1]["partial"] is False
    assert slurm.calls.count("sacct") == 1
    # Every later attempt / array task of any job on that partition uses the file, asks nothing.
    later = FakeSlurm()
    m3, line3, p3 = fc.failure_model_for_job(JobEnvironment(job_id="42", partition="gpu", array_task_id="3"),
                                             DEFAULT, window_days=90, runner=later, environ=env)
    assert p3 is None and later.calls == [] and "cached" in line3
    assert m3.per_node_rate == got[0].per_node_rate and m3.n_failures == got[0].n_failures
    # Another window or partition is another entry.
    assert fc.cache_path("gpu", 30, env) != fc.cache_path("gpu", 90, env) != fc.cache_path("cpu", 90, env)


def test_a_cache_older_than_a_day_is_refreshed(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path = fc.cache_path("gpu", 90, env)
    fc.store(path, from_mtbf(5 * 3600), {"records": 0, "incidents": 0})
    slurm = FakeSlurm()
    slurm.release.set()
    model, line, pending = fc.failure_model_for_job(JOB, DEFAULT, window_days=90, runner=slurm, environ=env,
                                                    now=time.time() + fc.MAX_AGE_S + 60)
    assert pending is not None and "stale cache" in line
    assert abs(model.per_node_rate - 1 / (5 * 3600)) < 1e-12          # starts with the stale one
    pending.join(30)
    assert pending.result() is not None and slurm.calls.count("sacct") == 1
    assert not path.with_name(path.name + ".refreshing").exists()


def test_private_data_jobs_makes_the_model_partial(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    private = CONFIG.replace("PrivateData             = none", "PrivateData             = accounts,jobs")
    assert fc.private_jobs(private) and not fc.private_jobs(CONFIG)
    slurm = FakeSlurm(private)
    slurm.release.set()
    _, _, pending = fc.failure_model_for_job(JOB, DEFAULT, window_days=90, runner=slurm, environ=env)
    assert pending is not None
    pending.join(30)
    got = pending.result()
    assert got is not None and got[1]["partial"] is True
    assert "PARTIAL: PrivateData=jobs" in fc.describe("gpu", got[1])
    _, line, _ = fc.failure_model_for_job(JOB, DEFAULT, window_days=90, runner=FakeSlurm(), environ=env)
    assert "PARTIAL" in line                                            # said again from the cache


def test_the_session_starts_at_once_and_switches_to_the_history_when_it_arrives(tmp_path: Path) -> None:
    import torch

    from coci_hpc.session import Session

    slurm = FakeSlurm()

    def runner(argv):
        if argv[0] == "sacct" and "-j" in argv:
            return ""                       # this job's own attempts: none listed yet
        return slurm(argv)
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_PARTITION": "gpu", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    m = torch.nn.Linear(2, 1)
    s = Session({"model": m}, 400, ckpt_dir=tmp_path / "ck", policy="young", environ=env, runner=runner)
    models = []
    for step in s.steps():
        models.append(s.schedule.failure_model)
        if step == 3:
            slurm.release.set()
        if step > 3 and s.history.pending is None:
            break
        time.sleep(0.005)
    assert models[0] is not None and abs(models[0].per_node_rate - DEFAULT.per_node_rate) < 1e-15
    assert s.schedule.failure_model.n_failures >= 1          # the partition's history, read meanwhile
    assert fc.load(fc.cache_path("gpu", 90, env)) is not None
