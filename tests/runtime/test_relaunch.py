"""The relaunch loop (runtime/relaunch.py): its pure policy (decide, choose_nodes), the loop's
I/O with Slurm faked at its commands, and the peer notice it posts when srun reports a lost task."""
from __future__ import annotations

from coci_hpc.runtime.relaunch import Relauncher, choose_nodes, decide

HELD = ["n1", "n2", "n3"]


def _decide(**kw):
    base = dict(rc=1, signaled=False, held=HELD, unhealthy={}, needed=2, restarts_done=0, max_restarts=3)
    return decide(**{**base, **kw})


def test_success_and_slurm_stops_are_not_relaunched() -> None:
    assert _decide(rc=0).action == "done"
    assert _decide(rc=143, signaled=True).action == "stop"   # preemption/time limit: the Session requeued


def test_lost_node_relaunches_on_the_healthy_ones() -> None:
    d = _decide(held=["n1", "n3"], unhealthy={})            # --no-kill: the DOWN node left the job
    assert d.action == "relaunch" and d.nodes == ("n1", "n3")
    d = _decide(unhealthy={"n2": "down*"})                  # still listed, but down
    assert d.action == "relaunch" and d.nodes == ("n1", "n3") and "n2 (down*) lost" in d.reason


def test_crash_with_every_node_healthy_relaunches_then_gives_up() -> None:
    d = _decide(rc=1, restarts_done=2)
    assert d.action == "relaunch" and d.nodes == ("n1", "n2") and "restart 3 of 3" in d.reason
    d = _decide(rc=1, restarts_done=3)
    assert d.action == "give_up" and "status 1" in d.reason and "--max-restarts 3" in d.reason
    assert _decide(rc=1, max_restarts=0).action == "give_up"


def test_requeue_when_too_few_nodes_or_budget_spent_on_node_losses() -> None:
    d = _decide(held=["n1", "n3"], unhealthy={"n3": "down*"})
    assert d.action == "requeue" and "1 healthy node(s) left" in d.reason
    d = _decide(held=["n1", "n3"], unhealthy={"n2": "down"}, restarts_done=3)
    assert d.action == "requeue" and "spent" in d.reason


def test_choose_nodes_keeps_slurm_order() -> None:
    assert choose_nodes(["n1", "n2", "n3"], {"n1": "drain"}, 2) == ("n2", "n3")
    assert choose_nodes(["n1"], {}, 2) is None


def test_a_node_that_lost_a_task_gives_way_to_a_spare() -> None:
    """The loop decides within a second of a lost task, before Slurm may mark a dying node down:
    a healthy spare is taken instead of the node that lost the task, which is used only when no
    other healthy node is left."""
    assert choose_nodes(["n1", "n2", "n3"], {}, 2, suspect={"n2"}) == ("n1", "n3")
    assert choose_nodes(["n1", "n2", "n3"], {}, 2, suspect={"n1"}) == ("n2", "n3")
    assert choose_nodes(["n1", "n3"], {}, 2, suspect={"n3"}) == ("n1", "n3")
    d = _decide(rc=1, suspect={"n2"})
    assert d.action == "relaunch" and d.nodes == ("n1", "n3") and "(not n2: lost a task)" in d.reason


def test_rank_step_is_srun_no_kill_on_exactly_the_chosen_nodes() -> None:
    r = Relauncher("/w/train.py", ("--steps", "5"), nodes=2, ntasks_per_node=2, mpi="pmix",
                   python="'/my py/python'", log_dir="/w/logs")
    argv = r.step_argv(("n1", "n3"))
    assert argv[:2] == ["srun", "--no-kill"]
    assert "--nodelist=n1,n3" in argv and "--nodes=2" in argv and "--ntasks=4" in argv and "--mpi=pmix" in argv
    assert argv[argv.index("--output") + 1] == "/w/logs/%j_%t_log.out"
    assert argv[-7:] == ["/my py/python", "-u", "-m", "coci_hpc.submit.rank", "/w/train.py", "--steps", "5"]


def test_a_session_that_gave_up_is_never_relaunched(tmp_path) -> None:
    """The Session's no-progress guard now sees in-place restarts; when it gives up (non-zero exit)
    the loop must end the job with that reason instead of relaunching into the same verdict."""
    from coci_hpc.runtime.events import EventLog
    from coci_hpc.runtime.relaunch import _session_gave_up

    d = _decide(rc=1, gave_up="4 attempts in a row started from step 40")
    assert d.action == "give_up" and "training session gave up: 4 attempts in a row" in d.reason
    assert _decide(rc=0, gave_up="x").action == "done"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert _session_gave_up(ckpt) is None
    EventLog(ckpt / "events.jsonl", attempt=1, job_id="7").write("end", step=40, status="error", message="boom")
    assert _session_gave_up(ckpt) is None
    EventLog(ckpt / "events.jsonl", attempt=2, job_id="7").write("end", step=40, status="gave_up", message="no progress")
    assert _session_gave_up(ckpt) == "no progress"


FAKE_LOSS_SRUN = """#!/bin/sh
echo "srun: job step started" >&2
sleep 0.3
echo "srun: error: n2: task 1: Killed" >&2
i=0
while [ $i -lt 40 ]; do
  if [ -e "{notice}" ]; then
    cp "{notice}" "{seen}"; echo "srun: error: n1: task 0: Exited with exit code 1" >&2; exit 1
  fi
  sleep 0.05; i=$((i+1))
done
exit 9
"""


def test_a_lost_task_posts_the_peer_notice_at_once(tmp_path) -> None:
    """srun's "task 1: Killed" makes the loop post the step's peer notice right away (the survivors
    then save at once instead of after their 5 s deadline); the fake step sees the file while it
    still runs and ends with it. A step without a lost task posts nothing."""
    import os
    import stat
    import time

    from coci_hpc.runtime import peernotice
    from coci_hpc.runtime.relaunch import StepLoss

    notice, seen = tmp_path / ".7_0_peer_notice", tmp_path / "seen"
    fake = tmp_path / "srun"
    fake.write_text(FAKE_LOSS_SRUN.format(notice=notice, seen=seen))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    t0 = time.monotonic()
    loss = StepLoss()
    r = Relauncher("t.py", (), 2, 1, "pmix", "python", str(tmp_path), step_grace_s=30.0)
    env = {**os.environ, peernotice.ENV: str(notice)}
    assert r.run_step([str(fake)], env, loss) == 1   # 9: no notice seen
    assert time.monotonic() - t0 < 5     # the fake step gives up waiting for the notice after 2.3 s
    assert loss.nodes == ["n2"]         # the survivor on n1 that left after the notice is not suspect
    assert seen.read_text().startswith("srun: error: n2: task 1: Killed")

    notice.unlink()
    ok = tmp_path / "srun-ok"
    ok.write_text("#!/bin/sh\necho 'srun: job step started' >&2\nexit 0\n")
    ok.chmod(ok.stat().st_mode | stat.S_IXUSR)
    assert r.run_step([str(ok)], env, StepLoss()) == 0 and not notice.exists()

    # Each launch of the loop gets its own notice, in the job's log folder, through the step's env.
    assert r.notice_path("7", 0) != r.notice_path("7", 1)
    assert os.path.dirname(r.notice_path("7", 1)) == str(tmp_path)


def test_the_loop_asks_slurm_again_before_relaunching_on_a_node_that_lost_a_task(tmp_path, monkeypatch,
                                                                                capfd) -> None:
    """The spare is spent (the job holds n1,n3) and n3's task is killed; Slurm marks n3 DOWN a moment
    later. Deciding at once would relaunch on n3; the loop waits until settle_s after the loss, asks
    again, and requeues (one healthy node left). A spare, when there is one, needs no wait."""
    import time

    from coci_hpc.runtime import relaunch as rl

    for k in ("COCI_CKPT_DIR", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    held = [["n1", "n3"]]
    requeued: list[str] = []
    monkeypatch.setattr(rl.commands, "job_nodes", lambda job: list(held[0]))
    monkeypatch.setattr(rl.commands, "unhealthy_nodes", lambda nodes: {})
    monkeypatch.setattr(rl.commands, "requeue", lambda job: requeued.append(job))

    class Loop(rl.Relauncher):
        def run_step(self, argv, env, loss, nodes=()):
            loss.at, loss.nodes = time.monotonic(), ["n3"]

            def slurm_marks_n3_down():
                time.sleep(0.3)
                held[0] = ["n1"]
            import threading
            threading.Thread(target=slurm_marks_n3_down).start()
            return 1
    t0 = time.monotonic()
    assert Loop("t.py", (), 2, 1, "pmix", "python", str(tmp_path), settle_s=1.0)() == 0
    assert requeued == ["7"] and 0.9 < time.monotonic() - t0 < 5
    err = capfd.readouterr().err
    assert "relaunching on n3, which lost a task: asking Slurm again" in err and "1 healthy node(s) left" in err


def test_submit_uses_the_runtime_through_its_one_entry_point() -> None:
    """issue 22: coci-submit (submit/) imports nothing of runtime/ but runtime/entry.py, and never
    the Session; the relaunch loop lives in runtime/ and its srun supervision in slurm/."""
    import ast
    from pathlib import Path

    import coci_hpc

    pkg = Path(coci_hpc.__file__).parent
    bad = []
    for f in sorted((pkg / "submit").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "coci_hpc.runtime":
                    mods = [f"coci_hpc.runtime.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                inside = m.startswith("coci_hpc.runtime.") or m == "coci_hpc.session"
                if inside and not m.startswith("coci_hpc.runtime.entry"):
                    bad.append(f"{f.name}: {m}")
    assert bad == []
    assert not (pkg / "submit" / "relaunch.py").exists()
    srun = ast.parse((pkg / "slurm" / "srun_step.py").read_text())   # the Slurm boundary does not reach up
    assert not [n.module for n in ast.walk(srun) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith(("coci_hpc.runtime", "coci_hpc.submit"))]
