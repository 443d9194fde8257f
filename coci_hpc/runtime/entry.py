"""What coci-submit (``coci_hpc.submit``) uses of the runtime: its one entry point.

submit/ runs on the login node and hands submitit the callables that run inside the allocation;
it needs the relaunch loop (``--spare-nodes``), the signals the runtime owns while a job runs and
the one record-only signal class (the runner's placeholder until the Session starts),
and, to check a checkpoint directory at submission as the Session checks it at start, the run
recorded in its event log. Everything else in runtime/ is internal to it.
"""
from __future__ import annotations

from coci_hpc.runtime.events import read_events
from coci_hpc.runtime.relaunch import DEFAULT_MAX_RESTARTS, Relauncher
from coci_hpc.runtime.runrecord import HINT as RUN_RECORD_HINT
from coci_hpc.runtime.runrecord import current_run, difference, recorded_run
from coci_hpc.runtime.signals import DEFAULT_SIGNALS, SignalRecorder

__all__ = ["DEFAULT_MAX_RESTARTS", "DEFAULT_SIGNALS", "RUN_RECORD_HINT", "Relauncher", "SignalRecorder", "current_run",
           "difference", "read_events", "recorded_run"]
