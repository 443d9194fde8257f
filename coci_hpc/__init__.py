"""coci_hpc: fault tolerance for deep-learning training on Slurm."""
from __future__ import annotations

from typing import Any

from coci_hpc.runtime.signals import shield as _shield
from coci_hpc.runtime.signals import stacks_on_request as _stacks_on_request

__version__ = "0.1.0"
__all__ = ["Session", "init_distributed"]

# As early as possible: DataLoader workers started after this (forked or spawned, before or
# after Session()) do not die of the signals Slurm sends to every process of the job step.
_shield()
# A rank that hangs says where on request (SIGQUIT: every thread's stack to its log).
_stacks_on_request()


def __getattr__(name: str) -> Any:
    # Lazy: `import coci_hpc` (the CLIs) must not pay for importing torch.
    if name == "Session":
        from coci_hpc.session import Session
        return Session
    if name == "init_distributed":
        from coci_hpc.runtime.distributed import init_distributed
        return init_distributed
    raise AttributeError(f"module 'coci_hpc' has no attribute {name!r}")
