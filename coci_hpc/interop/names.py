"""Tensor names as other stacks expect them: wrapper prefixes removed, user renames applied."""
from __future__ import annotations

import re
from collections.abc import Sequence

from coci_hpc.checkpoint.fqn import clean_saved
from coci_hpc.errors import UsageError


def clean(name: str) -> str:
    """``module._orig_mod.layers.0._fsdp_wrapped_module.w`` -> ``layers.0.w`` (the store's own
    naming, :func:`coci_hpc.checkpoint.fqn.clean_saved`; a block compiled on its own,
    ``layers.0._orig_mod.w``, too)."""
    return clean_saved(name)


def parse_renames(specs: Sequence[str]) -> list[tuple[re.Pattern[str], str]]:
    """``["^model\\.=", "attn=attention"]`` -> compiled (pattern, replacement) pairs."""
    out = []
    for s in specs:
        if "=" not in s:
            raise UsageError(f"--rename {s!r} is not PATTERN=REPL",
                             hint="e.g. --rename '^backbone\\.=' drops a 'backbone.' prefix")
        pat, repl = s.split("=", 1)
        try:
            out.append((re.compile(pat), repl))
        except re.error as exc:
            raise UsageError(f"--rename {s!r}: {pat!r} is not a regular expression: {exc}",
                             hint="PATTERN is a Python regular expression") from exc
    return out


def rename(name: str, renames: Sequence[tuple[re.Pattern[str], str]]) -> str:
    for pat, repl in renames:
        name = pat.sub(repl, name)
    return name
