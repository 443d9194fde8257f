"""``coci_hpc.runtime.signals.stacks_on_request``: inside a Slurm job step, SIGQUIT prints every
thread's stack (the main thread's too, while it waits inside a C call) and the process goes on;
outside a step, or with the program's own SIGQUIT handler, nothing changes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# The main thread waits inside a C call (a lock acquire) while another thread sends the SIGQUIT;
# the dump must name the function the main thread waits in.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    {before}
    import coci_hpc
    from coci_hpc.runtime import signals
    print("registered", signals._stacks_registered, flush=True)
    lock = threading.Lock(); lock.acquire()
    def later():
        time.sleep(0.3); os.kill(os.getpid(), signal.SIGQUIT); time.sleep(0.3); lock.release()
    threading.Thread(target=later).start()
    def waiting_in_c():
        lock.acquire()
    waiting_in_c()
    print("went on", flush=True)
""")


def run(env: dict[str, str], before: str = "") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-c", SCRIPT.format(before=before)], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(ROOT), **env}, timeout=60)


def test_inside_a_step_sigquit_prints_every_stack_and_the_process_goes_on() -> None:
    p = run({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})
    assert p.returncode == 0, p.stderr
    assert "registered True" in p.stdout and "went on" in p.stdout
    assert "in waiting_in_c" in p.stderr and "in later" in p.stderr, p.stderr    # both threads


def test_outside_a_step_sigquit_keeps_its_default_action() -> None:
    p = run({})
    assert "registered False" in p.stdout and "went on" not in p.stdout
    assert p.returncode == -signal.SIGQUIT, (p.returncode, p.stderr)


def test_the_programs_own_sigquit_handler_is_kept() -> None:
    p = run({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"},
            before="signal.signal(signal.SIGQUIT, lambda *a: print('own handler', flush=True))")
    assert p.returncode == 0, p.stderr
    assert "registered False" in p.stdout and "own handler" in p.stdout and "went on" in p.stdout
    assert "in waiting_in_c" not in p.stderr


def test_a_stderr_without_a_file_descriptor_leaves_the_import_working() -> None:
    # a notebook kernel's stderr (io.StringIO here) has no fileno(): faulthandler cannot write to it
    p = run({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}, before="import io; sys.stderr = io.StringIO()")
    assert "registered False" in p.stdout, p.stdout + p.stderr
