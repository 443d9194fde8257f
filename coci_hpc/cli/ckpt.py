"""coci-ckpt: list, verify, inspect, export and import coci_hpc checkpoints.

    coci-ckpt list DIR                 committed (and uncommitted) steps; damaged ones marked
    coci-ckpt verify DIR [STEP]        recompute every shard checksum (default: all committed steps)
    coci-ckpt inspect DIR STEP         tensors, shapes, dtypes, bytes and the ranks that wrote them
    coci-ckpt export DIR --to hf|torch|dcp OUT    the model for Hugging Face, torch.load, DCP
    coci-ckpt import SRC OUT           pretrained weights (safetensors, torch.save, DCP) as a coci checkpoint

Every subcommand takes ``--json`` (one JSON object on stdout) and the tool ``--version``. Heavy modules (torch, h5py)
are imported only by the subcommand that needs them: ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coci_hpc.cli.common import UsageArgumentParser, add_json, print_json, run_cli
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


def _emit(args: argparse.Namespace, doc: Any) -> None:
    if args.json:
        print_json(doc)


def files_problem(directory: Path, m: dict[str, Any]) -> str | None:
    """Cheap check of a committed step (no data read): every data file its manifest names is
    there, a regular file, and long enough for the datasets the manifest places in it."""
    need: dict[str, int] = defaultdict(int)
    for t in m["tensors"]:
        off = t.get("offset")
        end = (off + t["nbytes"]) if isinstance(off, int) else 0
        need[t["file"]] = max(need[t["file"]], end)
    for f in m["files"]:
        p = directory / f
        if p.is_symlink() or not p.exists():
            return f"{f} is missing"
        if not p.is_file():
            return f"{f} is not a regular file"
        size = p.stat().st_size
        if size < need.get(f, 0):
            return f"{f} is {size} bytes, shorter than the {need[f]} its manifest says (truncated)"
    return None


def cmd_list(args: argparse.Namespace) -> int:
    """Every step directory; a damaged step (manifest, missing or short data file) is DAMAGED
    (exit 7), never "latest", never a traceback."""
    from coci_hpc.checkpoint import catalog as cat

    infos = cat.scan(_root(args.dir))
    rows: list[dict[str, Any]] = []
    damaged: list[str] = []
    for c in infos:
        try:
            size = sum(p.stat().st_size for p in c.path.iterdir() if p.is_file())
        except OSError:
            size = 0
        row: dict[str, Any] = {"step": c.step, "status": "uncommitted", "ranks": None, "bytes": size,
                               "written": None, "problem": None}
        if c.committed:
            try:
                m = cat.read_manifest(c.path)
                problem = files_problem(c.path, m)
            except CheckpointCorrupt as exc:
                m, problem = None, exc.message
            if problem is not None:
                row.update(status="damaged", problem=problem)
                damaged.append(f"step {c.step}: {problem}")
            else:
                assert m is not None
                row.update(status="committed", ranks=m["world_size"], written=_when(m))
        rows.append(row)
    healthy = [r for r in rows if r["status"] == "committed"]
    latest = healthy[-1]["step"] if healthy else None
    for r in healthy[-1:]:
        r["status"] = "latest"
    if args.json:
        _emit(args, {"dir": args.dir, "latest": latest, "steps": rows})
    elif not rows:
        print(f"no checkpoints under {args.dir}")
    else:
        print(f"{'step':>10}  {'status':<11} {'ranks':>5} {'size':>10}  written")
        for r in rows:
            ranks = "-" if r["ranks"] is None else r["ranks"]
            tail = {"damaged": r["problem"], "uncommitted": "(ignored by loaders)"}.get(r["status"], r["written"])
            status = r["status"].upper() if r["status"] in ("damaged", "uncommitted") else r["status"]
            print(f"{r['step']:>10}  {status:<11} {ranks:>5} {_human(r['bytes']):>10}  {tail}")
    if damaged:
        raise CheckpointCorrupt(f"{len(damaged)} damaged checkpoint(s); first: {damaged[0]}",
                                hint="loaders skip them (load_latest falls back to an older step); "
                                     "`coci-ckpt verify DIR STEP` shows details")
    return 0


class _Progress:
    """A one-line progress display on a terminal's stderr, shown once a job runs past ~2 s."""

    def __init__(self, what: str, after_s: float = 2.0) -> None:
        self.what = what
        self.t0 = time.monotonic()
        self.after_s = after_s
        self.on = sys.stderr.isatty()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.on or time.monotonic() - self.t0 < self.after_s:
            return
        pct = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"\r{self.what}: {_human(done)} of {_human(total)} ({pct:.0f}%)   ")
        sys.stderr.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def verify_step(root: Path, step: int, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Problems found in one committed checkpoint (empty list = good): every shard's checksum,
    the manifest's own checksum and schema, the links and datasets of the data files."""
    from coci_hpc.checkpoint import catalog as cat
    from coci_hpc.checkpoint.h5read import DatasetReader
    from coci_hpc.checkpoint.manifest import shard_nbytes

    d = cat.step_dir(root, step)
    try:
        m = cat.read_manifest(d)
    except CheckpointCorrupt as exc:
        return [f"step {step}: {exc.message}"]
    by_dataset = {t["dataset"]: t for t in m["tensors"]}
    problems: list[str] = []
    readers: dict[str, DatasetReader] = {}
    sizes = [shard_nbytes(s, by_dataset[s["dataset"]]) for s in m["shards"]]
    total = sum(sizes)
    done = 0
    try:
        for s, n in zip(m["shards"], sizes):
            if s["file"] not in readers:
                try:
                    readers[s["file"]] = DatasetReader(d / s["file"], m)
                except CheckpointCorrupt as exc:
                    problems.append(f"step {step}: {exc.message}")
                    break
            try:  # every byte of the shard (a DTensor box: each of its runs) against its checksum
                readers[s["file"]].verify({(s["dataset"], s["start"])})
            except CheckpointCorrupt as exc:  # the reader checks the shard's checksum and names it
                problems.append(f"step {step}: {exc.message}")
            done += n
            if progress is not None:
                progress(done, total)
    finally:
        for r in readers.values():
            r.close()
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    from coci_hpc.checkpoint import catalog as cat

    root = _root(args.dir)
    steps = [args.step] if args.step is not None else cat.committed_steps(root)
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint under {root}", hint="nothing to verify")
    bad: list[str] = []
    results = []
    for step in steps:
        bar = _Progress(f"verifying step {step}")
        try:
            problems = verify_step(root, step, bar)
        finally:
            bar.end()
        results.append({"step": step, "ok": not problems, "problems": problems})
        if not args.json:
            print(f"step {step}: {'OK' if not problems else 'CORRUPT'}")
            for p in problems:
                print(f"  {p}")
        bad.extend(problems)
    _emit(args, {"dir": args.dir, "steps": results})
    if bad:
        raise CheckpointCorrupt(f"{len(bad)} bad shard(s); first: {bad[0]}",
                                hint="load an older committed step (coci-ckpt list DIR)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from coci_hpc.checkpoint import catalog as cat

    root = _root(args.dir)
    m = cat.read_manifest(cat.step_dir(root, args.step))
    writers: dict[str, set[int]] = defaultdict(set)
    for s in m["shards"]:
        writers[s["dataset"]].add(s["rank"])
    when = _when(m)
    total = sum(t["nbytes"] for t in m["tensors"])
    if args.json:
        _emit(args, {"step": m["step"], "world_size": m["world_size"], "backend": m["backend"], "written": when,
                     "format_version": m["format_version"], "bytes": total,
                     "tensors": [{"tensor": t["dataset"], "kind": t["kind"], "dtype": t["dtype"],
                                  "shape": t["shape"], "bytes": t["nbytes"],
                                  "ranks": sorted(writers.get(t["dataset"], ()))} for t in m["tensors"]]})
        return 0
    print(f"step {m['step']}  world_size {m['world_size']}  backend {m['backend']}  written {when}  "
          f"format v{m['format_version']}  {len(m['tensors'])} tensors, {_human(total)}")
    w = max([len(t["dataset"]) for t in m["tensors"]] + [6])
    print(f"{'tensor':<{w}}  {'kind':<10} {'dtype':<15} {'shape':<18} {'bytes':>12}  ranks")
    for t in m["tensors"]:
        ranks = ",".join(str(r) for r in sorted(writers.get(t["dataset"], ()))) or "-"
        shape = "x".join(str(x) for x in t["shape"]) or "scalar"
        print(f"{t['dataset']:<{w}}  {t['kind']:<10} {t['dtype']:<15} {shape:<18} {t['nbytes']:>12}  {ranks}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from coci_hpc.interop.export import describe, export

    bar = _Progress(f"exporting to {args.out}")
    try:
        result = export(args.dir, args.out, to=args.to, step=args.step, model_key=args.model_key,
                        with_optimizer=args.with_optimizer, dtype=args.dtype, rename=args.rename,
                        max_shard_size=args.max_shard_size, progress=bar)
    finally:
        bar.end()
    if args.json:
        _emit(args, result.as_dict())
    else:
        print(describe(result))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from coci_hpc.interop.pretrained import import_to_checkpoint

    out = import_to_checkpoint(args.src, args.out, step=args.step, model_key=args.model_key)
    if args.json:
        _emit(args, out)
    else:
        print(f"imported {out['tensors']} tensors ({out['bytes'] / 1e9:.3f} GB, {out['kind']}) from "
              f"{args.src} as step {out['step']} of {args.out}; start a run from it with "
              f"Session(..., init_from={args.out!r})")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = UsageArgumentParser(prog="coci-ckpt", description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        a = sub.add_parser(name, help=help)
        add_json(a)
        a.set_defaults(fn=fn)
        return a

    a = add("list", "list checkpoints (damaged ones marked, exit 7)", cmd_list)
    a.add_argument("dir")
    a = add("verify", "recompute shard checksums; non-zero exit names bad shards", cmd_verify)
    a.add_argument("dir")
    a.add_argument("step", nargs="?", type=int)
    a = add("inspect", "tensors, shapes, dtypes, bytes, ranks of one step", cmd_inspect)
    a.add_argument("dir")
    a.add_argument("step", type=int)
    a = add("export", "write the model as Hugging Face safetensors, a torch.save file or DCP", cmd_export)
    a.add_argument("dir", help="checkpoint root")
    a.add_argument("out", help="output directory (hf, dcp) or file (torch); must not exist")
    a.add_argument("--to", required=True, choices=("hf", "torch", "dcp"))
    a.add_argument("--step", type=int, help="default: the newest committed step")
    a.add_argument("--model-key", default="model", help="state key of the model (default: model)")
    a.add_argument("--with-optimizer", action="store_true",
                   help="also every other state value, under its key as prefix")
    a.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating model weights")
    a.add_argument("--rename", action="append", default=[], metavar="PATTERN=REPL",
                   help="regex rename of tensor names, after wrapper prefixes are removed (repeatable)")
    a.add_argument("--max-shard-size", default="5GB", help="hf: bytes per file (default 5GB; e.g. 256MB)")
    a = add("import", "pretrained weights (safetensors dir/file, torch.save file, DCP dir) as a coci "
                      "checkpoint holding {'model': ...}", cmd_import)
    a.add_argument("src")
    a.add_argument("out", help="checkpoint root to create (must hold no checkpoint)")
    a.add_argument("--step", type=int, default=0, help="step number to write (default 0)")
    a.add_argument("--model-key", default="model", help="state key to store the weights under")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    return args.fn(args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("coci-ckpt", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
