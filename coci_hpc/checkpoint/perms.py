"""Who may read a checkpoint: private by default, or shared with the group on request.

Checkpoints hold model weights and data positions; on a shared cluster the umask (often 022)
would make them world-readable. So modes are set explicitly, whatever the umask:

==============  ===========  ======  =====================================================
``access``      directories  files   use
==============  ===========  ======  =====================================================
"private"       0700         0600    default: only the owner
"group-read"    0750         0640    colleagues in the group may load / inspect
"group-write"   0770         0660    the group may also resume and save (a shared project)
==============  ===========  ======  =====================================================

Files take their step directory's mode minus the execute bits. The root directory gets the mode
when coci_hpc creates it; an existing root is left as its owner made it. For group access, give
the root the project's group (``chgrp proj ROOT; chmod g+s ROOT``) so new steps inherit it.
"""
from __future__ import annotations

import os
from pathlib import Path

from coci_hpc.errors import UsageError

ACCESS: dict[str, int] = {"private": 0o700, "group-read": 0o750, "group-write": 0o770}


def dir_mode(access: str) -> int:
    """Directory mode for an ``access`` name; UsageError lists the valid ones."""
    try:
        return ACCESS[access]
    except (KeyError, TypeError):
        raise UsageError(f"access={access!r} is not one of {sorted(ACCESS)}",
                         hint="'private' (0700/0600, the default), 'group-read' (0750/0640) or "
                              "'group-write' (0770/0660)") from None


def file_mode(dmode: int) -> int:
    """A file's mode from its directory's: the read/write bits (0700 -> 0600, 0750 -> 0640)."""
    return dmode & 0o666


def make_dirs(path: str | os.PathLike, mode: int) -> None:
    """Create ``path`` and missing parents; the directories created here get ``mode``."""
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:  # another job made it meanwhile: its owner's choice stands
            continue
        os.chmod(p, mode)  # mkdir's mode is masked by the umask


def make_dir(path: str | os.PathLike, mode: int) -> None:
    """Create one new directory with ``mode`` (FileExistsError if it exists)."""
    os.mkdir(path)
    os.chmod(path, mode)


def set_file(path: str | os.PathLike, dmode: int) -> None:
    """Give a file created by a library (h5py) the mode its directory implies."""
    os.chmod(path, file_mode(dmode))
