"""devcluster's own logic without starting a cluster: failure reports, pid ownership, rendered config."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DEVCLUSTER


@pytest.fixture()
def dc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COCI_DEVCLUSTER_DIR", str(tmp_path / "state"))
    # The default ports, whatever cluster this run's own environment points at (a second cluster on
    # other ports, e.g. a CI run beside the shared one): the rendered config is checked against them.
    for var in ("COCI_SLURMCTLD_PORT", "COCI_SLURMDBD_PORT", "COCI_MARIADB_PORT", "COCI_SLURMD_BASE_PORT",
                "COCI_FIRST_JOB_ID", "COCI_MPI_PORT_MIN"):
        monkeypatch.delenv(var, raising=False)
    loader = importlib.machinery.SourceFileLoader("devcluster_under_test", str(DEVCLUSTER))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    mod.PIDS.mkdir(parents=True)
    mod.LOGS.mkdir(parents=True)
    return mod


def test_failed_start_prints_the_daemons_log_lines(dc) -> None:
    log = dc.LOGS / "fake.log"
    d = dc.Daemon("fake", ["sh", "-c", f"echo 'fatal: Unable to bind listen port 6817' >> {log}; exit 3"], log,
                  ready=lambda: False, wait_s=10)
    with pytest.raises(dc.DevclusterError) as ei:
        d.start()
    msg = str(ei.value)
    assert "fake exited during start-up" in msg
    assert "Unable to bind listen port 6817" in msg  # the relevant line, not just "failed"


def test_start_that_never_becomes_ready_times_out_with_log(dc) -> None:
    log = dc.LOGS / "slow.log"
    d = dc.Daemon("slow", ["sh", "-c", f"echo 'waiting for database' >> {log}; sleep 30"], log,
                  ready=lambda: False, wait_s=1.5)
    with pytest.raises(dc.DevclusterError, match="did not become ready.*") as ei:
        d.start()
    assert "waiting for database" in str(ei.value)
    assert d.stop()  # we started it, so `down` may stop it


def test_down_never_kills_a_process_that_only_reuses_a_recorded_pid(dc) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        d = dc.Daemon("slurmctld", ["true"], dc.LOGS / "x.log", ready=lambda: True)
        # A record whose pid is alive but whose start time differs: the pid was recycled.
        d.pid_file.write_text(json.dumps({"pid": other.pid, "start": "1", "argv": ["slurmctld"]}))
        assert d.owned_pid() is None
        assert d.stop() is False
        time.sleep(0.2)
        assert other.poll() is None  # still alive
    finally:
        other.kill()
        other.wait()


def test_rendered_config_has_the_partitions_and_preemption_the_tests_rely_on(dc) -> None:
    conf = dc.render_slurm_conf(3, "host1")
    assert "NodeName=n[1-3] NodeHostname=host1 NodeAddr=127.0.0.1 Port=[17001-17003] CPUs=1" in conf
    gpu = next(ln for ln in conf.splitlines() if ln.startswith("PartitionName=gpu"))
    urgent = next(ln for ln in conf.splitlines() if ln.startswith("PartitionName=urgent"))
    assert "Default=YES" in gpu and "GraceTime=" in gpu and "PreemptMode=REQUEUE" in gpu
    tier = lambda ln: int(ln.split("PriorityTier=")[1].split()[0])  # noqa: E731
    assert tier(urgent) > tier(gpu)
    assert "SlurmctldParameters=preempt_send_user_signal" in conf
    assert "PreemptType=preempt/partition_prio" in conf
    assert str(dc.STATE) in conf and "%n" in conf.split("SlurmdSpoolDir=")[1].splitlines()[0]
    assert dc.render_mpi_conf().strip().endswith(f"PMIxCliTmpDirBase={dc.STATE}/pmix")


def test_status_without_a_cluster_says_so_and_fails(tmp_path: Path) -> None:
    env = dict(os.environ, COCI_DEVCLUSTER_DIR=str(tmp_path / "none"))
    p = subprocess.run([str(DEVCLUSTER), "status"], capture_output=True, text=True, env=env)
    assert p.returncode == 1
    assert "no cluster configured" in p.stdout
    # with another checkout's cluster up on this machine, it says how to reuse that one instead
    assert "run `slurm/devcluster up`" in p.stdout or "reuse it with `export COCI_DEVCLUSTER_DIR=" in p.stdout


def test_user_signal_setting_is_rendered_and_read_back(dc) -> None:
    on, off = dc.render_slurm_conf(2, "h"), dc.render_slurm_conf(2, "h", user_signal=False)
    assert "SlurmctldParameters=preempt_send_user_signal" in on
    assert "SlurmctldParameters" not in off.replace("# No preempt_send_user_signal", "")
    assert dc.configured_user_signal() is True              # no config yet: the default
    dc.ETC.mkdir(parents=True, exist_ok=True)
    dc.SLURM_CONF.write_text(off)
    assert dc.configured_user_signal() is False and dc.configured_nodes() == 2


def test_scheduler_is_tuned_for_tests_and_applied_to_a_cluster_started_without_it(dc, monkeypatch) -> None:
    """A requeued job waited for the next 30 s backfill pass; the rendered config asks for a pass every
    second, and `up` on a running cluster that lacks it reconfigures (and only then)."""
    conf = dc.render_slurm_conf(2, "h")
    line = next(ln for ln in conf.splitlines() if ln.startswith("SchedulerParameters="))
    params = dict(kv.split("=") for kv in line.split("=", 1)[1].split(","))
    assert params == {"bf_interval": "1", "sched_interval": "1", "batch_sched_delay": "0"}
    calls: list[list[str]] = []

    def fake_run(cmd, check=True):  # noqa: ANN001, ANN202
        calls.append(cmd)
        out = f"SchedulerType           = sched/backfill\nSchedulerParameters     = {running}\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(dc, "run", fake_run)
    for running, reconfigured in (("(null)", True), (dc.SCHEDULER_PARAMETERS, False)):
        calls.clear()
        dc.apply_scheduler_parameters()
        assert (["scontrol", "reconfigure"] in calls) is reconfigured, (running, calls)


def test_kill_tasks_kills_only_that_nodes_job_processes(dc) -> None:
    """`fail --hard` finds a node's job processes by the SLURMD_NODENAME + SLURM_JOB_ID that
    slurmstepd gives every task (and its children inherit); other nodes' tasks and daemons live on."""
    dc.ETC.mkdir(parents=True)
    dc.SLURM_CONF.write_text(dc.render_slurm_conf(2, "localhost"))  # not write_config: it links /etc/slurm
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    conf = {"SLURM_CONF": str(dc.SLURM_CONF)}            # what slurmd gives every task it starts
    task = subprocess.Popen(["sleep", "60"],
                            env={**base, **conf, "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"})
    other = subprocess.Popen(["sleep", "60"],
                             env={**base, **conf, "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "7"})
    daemon = subprocess.Popen(["sleep", "60"], env={**base, **conf, "SLURMD_NODENAME": "n2"})
    # A task of another cluster on this machine (a shared dev cluster while this test runs): not ours.
    foreign = subprocess.Popen(["sleep", "60"], env={**base, "SLURM_CONF": "/elsewhere/slurm.conf",
                                                     "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"})
    try:
        assert task.pid in dc.job_processes("n2")
        assert other.pid not in dc.job_processes("n2") and daemon.pid not in dc.job_processes("n2")
        assert foreign.pid not in dc.job_processes("n2")
        killed = dc.cmd_kill_tasks("n2")
        assert task.pid in killed
        assert task.wait(5) == -9                      # SIGKILL: nothing it could act on
        assert other.poll() is None and daemon.poll() is None and foreign.poll() is None
        with pytest.raises(dc.DevclusterError, match="no node 'n9'"):
            dc.cmd_kill_tasks("n9")
    finally:
        for p in (task, other, daemon, foreign):
            p.kill()
            p.wait()


def test_the_task_prolog_keeps_open_mpi_on_loopback(dc, monkeypatch) -> None:
    """Issue 26, 16: after a lost peer the survivors' logs carried Open MPI's "failed to TCP connect"
    warning; every virtual node is this machine, so MPI's TCP traffic stays on `lo` (a job's own
    setting wins). Run as slurmd would: its `export` lines become the task's environment."""
    conf = dc.render_slurm_conf(2, "h")
    assert f"TaskProlog={dc.TASK_PROLOG}" in conf.splitlines()
    monkeypatch.setattr(dc, "link_system_conf", lambda: None)   # leave /etc/slurm alone
    dc.write_config(2)
    assert dc.TASK_PROLOG.stat().st_mode & 0o111 == 0o111        # slurmd must be able to exec it
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    p = subprocess.run([str(dc.TASK_PROLOG)], capture_output=True, text=True, env=env, check=True)
    ports = [f"export OMPI_MCA_btl_tcp_{k}_{v}={n}" for v in ("v4", "v6") for k, n in (("port_min", 1024),
                                                                                      ("port_range", 250))]
    assert p.stdout.splitlines() == ["export OMPI_MCA_btl_tcp_if_include=lo", "export OMPI_MCA_oob_tcp_if_include=lo",
                                     *ports]
    env["OMPI_MCA_btl_tcp_if_include"] = "eth0"
    env["OMPI_MCA_btl_tcp_port_min_v4"] = "5000"
    p = subprocess.run([str(dc.TASK_PROLOG)], capture_output=True, text=True, env=env, check=True)
    assert p.stdout.splitlines() == ["export OMPI_MCA_oob_tcp_if_include=lo", *ports[1:]]
    # each attempt of a requeued job listens in its own slice: 1024 + 250 * (restart count mod 4)
    del env["OMPI_MCA_btl_tcp_port_min_v4"]
    for restarts, low in (("1", 1274), ("3", 1774), ("4", 1024)):
        p = subprocess.run([str(dc.TASK_PROLOG)], capture_output=True, text=True, check=True,
                           env={**env, "SLURM_RESTART_COUNT": restarts})
        assert f"export OMPI_MCA_btl_tcp_port_min_v4={low}" in p.stdout.splitlines(), (restarts, p.stdout)


def test_a_frozen_process_that_a_signal_continues_is_stopped_again(dc) -> None:
    """A dead host's processes never run again; this host's slurmd delivers Slurm's SIGCONT when
    the survivors requeue the job before the node is marked down (CI, 2026-11-29)."""
    import signal
    import threading

    p = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.1)
        wake = threading.Timer(0.3, os.kill, (p.pid, signal.SIGCONT))
        wake.start()
        again, new = dc.keep_stopped([p.pid], 1.0, "n7")
        wake.join()
        assert again >= 1 and new == [] and dc.proc_state(p.pid) in ("T", "t")
        assert dc.keep_stopped([p.pid], 0.1, "n7") == (0, [])   # nothing continued it: nothing to do
    finally:
        p.kill()
        p.wait()


def test_a_dead_node_starts_nothing_new(dc) -> None:
    """While a failed node waits to be marked DOWN, a job process that appears on it (a requeued
    attempt Slurm placed there, not knowing the node is dead) is stopped at once and stays stopped;
    one on another node, or of another cluster, is left alone (CI, 2026-11-30: the attempt ran 46
    steps that the node's DOWN threw away)."""
    import threading

    def task(node: str, conf: str) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "60"], env={**os.environ, "SLURMD_NODENAME": node,
                                                      "SLURM_CONF": conf, "SLURM_JOB_ID": "99"})

    out: list = []
    hold = threading.Thread(target=lambda: out.append(dc.keep_stopped([], 2.0, "n7")))
    hold.start()
    time.sleep(0.3)
    procs = [task("n7", str(dc.SLURM_CONF)), task("n6", str(dc.SLURM_CONF)), task("n7", "/elsewhere/slurm.conf")]
    try:
        time.sleep(0.5)
        states = [dc.proc_state(p.pid) for p in procs]
        assert states[0] in ("T", "t") and states[1] not in ("T", "t") and states[2] not in ("T", "t"), states
        os.kill(procs[0].pid, signal.SIGCONT)         # Slurm's SIGCONT on the job's end: stopped again
        hold.join()
        assert out == [(out[0][0], [procs[0].pid])] and out[0][0] >= 1, out
        assert dc.proc_state(procs[0].pid) in ("T", "t")
        dc.kill_held("n7", out[0][1])
        assert procs[0].wait(5) == -signal.SIGKILL
    finally:
        hold.join()
        for p in procs:
            p.kill()
            p.wait()


def test_a_second_cluster_gets_its_own_job_ids_and_mpi_ports(tmp_path: Path, monkeypatch) -> None:
    """CI runs two clusters on this machine at once. Open MPI names a process after its Slurm job
    and listens on the lowest free port from its minimum: with equal job ids, a survivor that
    retries a dead peer's port could reach the other cluster's new rank under the name it expects.
    tests/run's second shard gets its own job ids and port range; the rendered config says so."""
    monkeypatch.setenv("COCI_DEVCLUSTER_DIR", str(tmp_path / "b"))
    monkeypatch.setenv("COCI_FIRST_JOB_ID", "10001")
    monkeypatch.setenv("COCI_MPI_PORT_MIN", "3024")
    loader = importlib.machinery.SourceFileLoader("devcluster_b", str(DEVCLUSTER))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    assert "FirstJobId=10001" in mod.render_slurm_conf(2, "h").splitlines()
    assert "port_min=$(( 3024 + 250 * (${SLURM_RESTART_COUNT:-0} % 4) ))" in mod.render_task_prolog()
    run = (Path(DEVCLUSTER).parent.parent / "tests" / "run").read_text()
    assert "COCI_FIRST_JOB_ID=10001 COCI_MPI_PORT_MIN=3024" in run     # the shard b environment
    assert 3024 >= 1024 + mod.MPI_PORT_RANGE                               # no overlap with shard a's ports
    assert mod.MPI_PORT_RANGE % mod.MPI_PORT_SLICE == 0                     # the attempts' slices tile it


def test_a_second_cluster_is_refused_naming_the_running_one(dc, tmp_path: Path, monkeypatch) -> None:
    """Issue 26: a fresh clone's `up` (or demo.sh) beside another checkout's running cluster clashed on the
    ports; it now stops before writing anything and says how to reuse the running one."""
    other = tmp_path / "other-checkout" / ".devcluster"
    (other / "etc").mkdir(parents=True)
    (other / "etc" / "slurm.conf").write_text(dc.MARKER + "\n")
    link = tmp_path / "etc-slurm" / "slurm.conf"
    link.parent.mkdir()
    link.symlink_to(other / "etc" / "slurm.conf")
    monkeypatch.setattr(dc, "SYSTEM_CONF", link)
    monkeypatch.setattr(dc, "port_open", lambda port, host="127.0.0.1": port == dc.CTLD_PORT)
    with pytest.raises(dc.DevclusterError, match="cannot start a second cluster") as ei:
        dc.cmd_up(2)
    assert f"export COCI_DEVCLUSTER_DIR={other}" in str(ei.value)
    assert not (dc.STATE / "etc").exists()  # nothing written for the refused cluster
    monkeypatch.setattr(dc, "port_open", lambda port, host="127.0.0.1": False)
    assert dc.other_cluster_dir() is None  # nothing answers: `up` goes ahead as before


def test_up_leaves_the_system_link_to_another_running_cluster(dc, tmp_path: Path, monkeypatch) -> None:
    """A second cluster on other ports (a CI run beside the shared one) must not take plain `sbatch`
    away from the running one: /etc/slurm/slurm.conf keeps linking to the cluster that answers, and is
    taken over once that one is gone (or when it links to nothing)."""
    other = tmp_path / "shared" / "etc" / "slurm.conf"
    other.parent.mkdir(parents=True)
    other.write_text(f"{dc.MARKER}\nSlurmctldPort=6817\n")
    link = tmp_path / "etc-slurm" / "slurm.conf"
    link.parent.mkdir()
    link.symlink_to(other)
    monkeypatch.setattr(dc, "SYSTEM_CONF", link)
    monkeypatch.setattr(dc, "CTLD_PORT", 7817)
    dc.ETC.mkdir(parents=True)
    dc.SLURM_CONF.write_text(dc.MARKER + "\n")
    monkeypatch.setattr(dc, "port_open", lambda port, host="127.0.0.1": port == 6817)
    dc.link_system_conf()
    assert link.resolve() == other.resolve()          # the running cluster keeps it
    monkeypatch.setattr(dc, "port_open", lambda port, host="127.0.0.1": False)
    dc.link_system_conf()
    assert link.resolve() == dc.SLURM_CONF.resolve()  # nothing answers there: ours now


def test_nodes_that_fail_together_are_all_killed_before_any_is_marked_down(dc, monkeypatch) -> None:
    """`fail n2 n3 --hard`: one command after another let the survivors of the first save before
    the second died (the memory-tier cluster test, CI 2026-12-01); together, every node's tasks
    are killed first."""
    done: list[tuple[str, str]] = []
    monkeypatch.setattr(dc, "cmd_kill_tasks", lambda node: done.append(("kill", node)))
    monkeypatch.setattr(dc, "keep_stopped", lambda frozen, delay, node: (0, []))
    monkeypatch.setattr(dc, "kill_held", lambda node, held: None)
    monkeypatch.setattr(dc, "cmd_fail", lambda node, reason: done.append(("down", node)))
    assert dc.main(["fail", "n2", "n3", "--hard", "--delay", "1"]) in (0, None)
    assert done == [("kill", "n2"), ("kill", "n3"), ("down", "n2"), ("down", "n3")]
    done.clear()
    assert dc.main(["fail", "n2", "--hard", "--delay", "1"]) in (0, None)
    assert done == [("kill", "n2"), ("down", "n2")]
    done.clear()
    assert dc.main(["fail", "n2", "n3", "--hard", "--freeze"]) != 0
    assert done == []
