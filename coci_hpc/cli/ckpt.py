"""coci-ckpt: list, verify and inspect coci_hpc checkpoints.

    coci-ckpt list DIR               committed (and uncommitted) steps
    coci-ckpt verify DIR [STEP]      recompute every shard checksum (default: all committed steps)
    coci-ckpt inspect DIR STEP       tensors, shapes, dtypes, bytes and the ranks that wrote them
"""
from __future__ import annotations

import argparse
import datetime as dt
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.h5file import DatasetReader
from coci_hpc.cli.common import UsageArgumentParser, run_cli
from coci_hpc.errors import CheckpointCorrupt, CheckpointNotFound


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _root(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFound(f"{root} is not a directory", hint="pass the checkpoint root directory")
    return root


def _when(m: dict) -> str:
    try:
        return dt.datetime.fromtimestamp(m["wall_time"]).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # read() refuses these; a format-1 file may hold one
        return "?"


def cmd_list(args: argparse.Namespace) -> int:
    """Every step directory; a damaged manifest is listed as DAMAGED (exit 7), never a traceback."""
    infos = mf.scan(_root(args.dir))
    if not infos:
        print(f"no checkpoints under {args.dir}")
        return 0
    latest = mf.latest_step(args.dir)
    damaged: list[str] = []
    print(f"{'step':>10}  {'status':<11} {'ranks':>5} {'size':>10}  written")
    for c in infos:
        try:
            size = sum(p.stat().st_size for p in c.path.iterdir() if p.is_file())
        except OSError:
            size = 0
        if c.committed:
            try:
                m = mf.read(c.path)
            except CheckpointCorrupt as exc:
                damaged.append(f"step {c.step}: {exc.message}")
                print(f"{c.step:>10}  {'DAMAGED':<11} {'-':>5} {_human(size):>10}  {exc.message}")
                continue
            status = "latest" if c.step == latest else "committed"
            print(f"{c.step:>10}  {status:<11} {m['world_size']:>5} {_human(size):>10}  {_when(m)}")
        else:
            print(f"{c.step:>10}  {'UNCOMMITTED':<11} {'-':>5} {_human(size):>10}  (ignored by loaders)")
    if damaged:
        raise CheckpointCorrupt(f"{len(damaged)} damaged checkpoint(s); first: {damaged[0]}",
                                hint="loaders skip them (load_latest falls back to an older step); "
                                     "`coci-ckpt verify DIR STEP` shows details")
    return 0


def verify_step(root: Path, step: int) -> list[str]:
    """Problems found in one committed checkpoint (empty list = good): every shard's checksum,
    the manifest's own checksum and schema, the links and datasets of the data files."""
    d = mf.step_dir(root, step)
    try:
        m = mf.read(d)
    except CheckpointCorrupt as exc:
        return [f"step {step}: {exc.message}"]
    by_dataset = {t["dataset"]: t for t in m["tensors"]}
    problems: list[str] = []
    readers: dict[str, DatasetReader] = {}
    try:
        for s in m["shards"]:
            if s["file"] not in readers:
                try:
                    readers[s["file"]] = DatasetReader(d / s["file"], m)
                except CheckpointCorrupt as exc:
                    problems.append(f"step {step}: {exc.message}")
                    break
            try:
                readers[s["file"]].read_bytes(by_dataset[s["dataset"]], s["start"], s["stop"])
            except CheckpointCorrupt as exc:  # the reader checks the shard's checksum and names it
                problems.append(f"step {step}: {exc.message}")
    finally:
        for r in readers.values():
            r.close()
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    steps = [args.step] if args.step is not None else mf.committed_steps(root)
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint under {root}", hint="nothing to verify")
    bad: list[str] = []
    for step in steps:
        problems = verify_step(root, step)
        print(f"step {step}: {'OK' if not problems else 'CORRUPT'}")
        for p in problems:
            print(f"  {p}")
        bad.extend(problems)
    if bad:
        raise CheckpointCorrupt(f"{len(bad)} bad shard(s); first: {bad[0]}",
                                hint="load an older committed step (coci-ckpt list DIR)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    root = _root(args.dir)
    m = mf.read(mf.step_dir(root, args.step))
    writers: dict[str, set[int]] = defaultdict(set)
    for s in m["shards"]:
        writers[s["dataset"]].add(s["rank"])
    when = _when(m)
    total = sum(t["nbytes"] for t in m["tensors"])
    print(f"step {m['step']}  world_size {m['world_size']}  backend {m['backend']}  written {when}  "
          f"format v{m['format_version']}  {len(m['tensors'])} tensors, {_human(total)}")
    w = max([len(t["dataset"]) for t in m["tensors"]] + [6])
    print(f"{'tensor':<{w}}  {'kind':<10} {'dtype':<15} {'shape':<18} {'bytes':>12}  ranks")
    for t in m["tensors"]:
        ranks = ",".join(str(r) for r in sorted(writers.get(t["dataset"], ()))) or "-"
        shape = "x".join(str(x) for x in t["shape"]) or "scalar"
        print(f"{t['dataset']:<{w}}  {t['kind']:<10} {t['dtype']:<15} {shape:<18} {t['nbytes']:>12}  {ranks}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = UsageArgumentParser(prog="coci-ckpt", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("list", help="list checkpoints")
    a.add_argument("dir")
    a.set_defaults(fn=cmd_list)
    a = sub.add_parser("verify", help="recompute shard checksums; non-zero exit names bad shards")
    a.add_argument("dir")
    a.add_argument("step", nargs="?", type=int)
    a.set_defaults(fn=cmd_verify)
    a = sub.add_parser("inspect", help="tensors, shapes, dtypes, bytes, ranks of one step")
    a.add_argument("dir")
    a.add_argument("step", type=int)
    a.set_defaults(fn=cmd_inspect)
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    return args.fn(args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("coci-ckpt", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
