"""Slurm's hostlist expressions (``n[1-3,5]``), as sacct, sacctmgr, sinfo and SLURM_JOB_NODELIST write them."""
from __future__ import annotations

import re


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist: ``n[1-3,5]``, ``gpu[01-02]-ib[1-2]``, ``a1,b[2-3]``."""
    expr = expr.strip()
    if not expr or expr.lower() in ("none", "none assigned", "(null)"):
        return []
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(cur)
    out: list[str] = []
    for p in parts:
        if p:
            out.extend(_expand_one(p))
    return out


def _expand_one(p: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", p)
    if not m:
        if "[" in p or "]" in p:
            raise ValueError(f"bad hostlist element {p!r}")
        return [p]
    head, body, tail = p[:m.start()], m.group(1), p[m.end():]
    items: list[str] = []
    for rng in body.split(","):
        if re.fullmatch(r"\d+", rng):
            items.append(rng)
        elif re.fullmatch(r"\d+-\d+", rng):
            a, b = rng.split("-")
            if int(b) < int(a):
                raise ValueError(f"descending range {rng!r}")
            width = len(a) if a.startswith("0") else 0
            items.extend(str(i).zfill(width) for i in range(int(a), int(b) + 1))
        else:
            raise ValueError(f"bad range {rng!r} in hostlist")
    return [head + it + rest for it in items for rest in _expand_one(tail)]
