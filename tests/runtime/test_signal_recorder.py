"""The one record-only signal class (issue 22): :class:`coci_hpc.runtime.signals.SignalRecorder`.

The Session, PreemptionGuard, the relaunch loop and coci-submit's runner (its placeholder before
the Session exists) all install this class; no other code of the package installs a signal
handler. A signal the runner held before the script's Session existed reaches that Session, once,
and the run stops at its first step boundary (a real Session in a child process here; the runner
with a stand-in Session is tests/submit/test_spec_runner.py)."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coci_hpc.runtime import preemption, relaunch, signals
from coci_hpc.runtime.events import Stop, read_records
from coci_hpc.runtime.signals import SignalRecorder
from coci_hpc.submit import runner
from tests.conftest import ROOT, clean_env

PKG = ROOT / "coci_hpc"
HANDLER_CONSTANTS = {"SIG_DFL", "SIG_IGN"}


def _handler_installs(path: Path) -> list[tuple[str, int]]:
    """(enclosing class or '', line) of each ``signal.signal(s, handler)`` whose handler is not
    SIG_DFL/SIG_IGN: where Python signal handlers get installed."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, cls: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr == "signal" and isinstance(child.func.value, ast.Name) \
                    and child.func.value.id == "signal" and len(child.args) == 2:
                h = child.args[1]
                if not (isinstance(h, ast.Attribute) and h.attr in HANDLER_CONSTANTS):
                    out.append((cls, child.lineno))
            visit(child, cls)
    visit(tree, "")
    return out


def test_signal_recorder_is_the_only_code_that_installs_a_signal_handler() -> None:
    found = {str(p.relative_to(ROOT)): sites for p in sorted(PKG.rglob("*.py")) if (sites := _handler_installs(p))}
    assert set(found) == {"coci_hpc/runtime/signals.py"}, found
    assert {cls for cls, _ in found["coci_hpc/runtime/signals.py"]} == {"SignalRecorder"}
    # the check sees what it looks for: the recorder installs its handler and restores the previous one
    assert len(found["coci_hpc/runtime/signals.py"]) >= 2


def test_every_owner_uses_the_same_class() -> None:
    assert preemption.SignalRecorder is SignalRecorder and relaunch.SignalRecorder is SignalRecorder
    assert preemption.PreemptionGuard().recorder.__class__ is SignalRecorder
    assert runner.SignalRecorder is SignalRecorder
    assert preemption.DEFAULT_SIGNALS == signals.DEFAULT_SIGNALS == signals.SHIELDED


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_placeholder_hands_a_held_signal_to_the_next_recorder_once() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    try:
        held = SignalRecorder([signal.SIGUSR1], hand_over=True, label="test", poll_s=0.01).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait(lambda: len(held.received) == 1)
        time.sleep(0.1)
        assert len(held.received) == 1                 # held, not handed over while nobody owns it
        owner = SignalRecorder([signal.SIGUSR1], chain=False).install()   # the Session's
        assert _wait(lambda: bool(owner.received))
        time.sleep(0.2)                                # handed over once, not in a loop
        assert [r.name for r in owner.received] == ["SIGUSR1"]
        assert len(held.received) == 1
        assert held._forwarder is not None and _wait(lambda: not held._forwarder.is_alive())
        owner.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == held._handle      # restored exactly
        signals.after_session()                        # the placeholder gives the default action back
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_chaining_recorder_calls_the_handler_it_replaced() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    got: list[int] = []
    try:
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        rec = SignalRecorder([signal.SIGUSR1]).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait(lambda: bool(got)) and [r.signum for r in rec.received] == [signal.SIGUSR1]
        quiet = SignalRecorder([signal.SIGUSR1], chain=False).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait(lambda: bool(quiet.received))
        assert len(got) == 1 and len(rec.received) == 1   # replaced, not chained
        quiet.uninstall()
        rec.uninstall()
    finally:
        signal.signal(signal.SIGUSR1, before)


# A user's script run by coci-submit's runner: the signal comes while it still imports (before
# Session() exists); the real Session must get it and stop at its first step boundary.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    time.sleep(0.2)
    import torch
    from coci_hpc import Session
    m = torch.nn.Linear(3, 1)
    s = Session({"model": m}, 40, ckpt_dir=sys.argv[1], policy="fixed:100", environ={})
    for step in s.steps():
        time.sleep(0.05)
    print("trained to the end", flush=True)
""")
RUNNER = textwrap.dedent("""
    import sys
    from coci_hpc.submit.runner import ScriptRunner
    rc = ScriptRunner(sys.argv[1], tuple(sys.argv[2:]), {})()
    print("runner returned", rc, flush=True)
""")


@pytest.mark.parametrize("signame, reason", [("SIGUSR2", "preemption"), ("SIGTERM", "terminated")])
def test_a_signal_before_the_session_exists_stops_the_real_session_at_its_first_boundary(
        tmp_path: Path, signame: str, reason: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ck"
    env = {k: v for k, v in clean_env().items() if not k.startswith(("SLURM_", "COCI_"))}
    p = subprocess.run([sys.executable, "-c", RUNNER, str(script), str(ckpt), signame], capture_output=True,
                       text=True, timeout=180, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "runner returned 0" in p.stdout and "trained to the end" not in p.stdout, p.stdout + p.stderr
    assert p.stderr.count(f"coci-submit: {signame} received while no training session runs") == 1, p.stderr
    stops = [r for r in read_records(ckpt) if isinstance(r, Stop)]
    assert len(stops) == 1, p.stderr
    assert stops[0].signal == signame and stops[0].reason == reason and stops[0].saved
    assert stops[0].step is not None and stops[0].step <= 2     # the first boundary (or the pipelined next)


def test_after_a_completed_loop_late_warnings_are_ignored_not_a_users_handler() -> None:
    before = {s: signal.getsignal(s) for s in signals.SHIELDED}
    try:
        for s in signals.SHIELDED:
            signal.signal(s, signal.SIG_DFL)
        signals.after_session(completed=False)         # a loop left early: defaults stay
        assert all(signal.getsignal(s) == signal.SIG_DFL for s in signals.SHIELDED)
        signals.after_session(completed=True)          # the run is done and saved
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        mine = lambda *a: None                         # noqa: E731
        signal.signal(signal.SIGUSR2, mine)
        signals.after_session(completed=True)
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)
