"""Export a committed coci checkpoint to Hugging Face safetensors, ``torch.save`` or DCP.

    export("/scratch/ckpt", "/scratch/out-hf", to="hf")                 # newest committed step
    export("/scratch/ckpt", "model.pt", to="torch", step=1200, dtype="bf16")

*The model* is the state value saved under the key ``model`` (``model_key=`` / ``--model-key``
names another): its tensors, named as its ``state_dict()`` names them, cleaned of wrapper
prefixes (:mod:`.names`). ``with_optimizer=True`` adds every other replicated state value
(optimizer, scheduler, extras) under its own key as prefix (``optimizer.state.fc1.weight.exp_avg``).

Every tensor is read on its own from the HDF5 file and checked against the CRC of each shard
holding its bytes before a byte of it is written (a damaged checkpoint fails naming the
tensor). The ``hf`` export holds at most one output shard plus one tensor in memory; ``torch``
and ``dcp`` hold the model (``torch.save`` and ``dcp.save`` take the whole state dict at once).
Everything is written under a temporary name next to ``out`` and renamed to ``out`` at the end:
``out`` appears complete or not at all (a failure, a full disk included, removes the temporary).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.rawio import DIRECT_ALIGN, aligned_empty, open_direct, preallocate, pwrite_all, pwrite_pages
from coci_hpc.checkpoint.treecode import unflatten
from coci_hpc.durable import fsync_dir, fsync_file, rename_durable
from coci_hpc.errors import CheckpointError, CociError, UsageError
from coci_hpc.interop import names
from coci_hpc.interop.source import MODEL_KEY, CheckpointSource, Entry, export_name, nbytes_as, torch_dtype

FORMATS = ("hf", "torch", "dcp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD = "5GB"
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, as Hugging Face counts), ``"256MiB"``, ``1000``."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
        if not m or m.group(2) not in _UNITS:
            raise UsageError(f"size {text!r} is not a size", hint="e.g. 5GB, 256MB, 512MiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise UsageError(f"size {text!r} must be positive", hint="e.g. 5GB")
    return n


@dataclass
class ExportResult:
    out: Path
    format: str
    step: int
    tensors: int
    bytes: int
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "format": self.format, "step": self.step, "tensors": self.tensors,
                "bytes": self.bytes, "files": self.files, "seconds": round(self.seconds, 3)}


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (a seam for tests that inject a full disk)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# The safetensors dtype names of the stored dtypes the direct writer takes (the format's own
# table: safetensors' README); anything else goes through safetensors.torch.save_file.
SAFE_DTYPES = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
               "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
               "torch.uint8": "U8", "torch.bool": "BOOL"}
_BOUNCE_MAX = 64 << 20   # bytes of the one reused buffer the direct writer reads through
DIRECT_WRITES = True     # whole pages with O_DIRECT (False: all through the page cache; for A/B runs)


def _safetensors_header(members: Sequence[tuple[str, Entry]], align: int = 8) -> bytes:
    """The file's 8-byte length and JSON header, padded with spaces (which the format allows) so
    that the data starts at a multiple of ``align`` (safetensors' own writer pads to 8); the data
    follows in ``members``' order, each tensor's bytes as stored."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, e in members:
        header[name] = {"dtype": SAFE_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % align)
    return len(text).to_bytes(8, "little") + text


def _windows(members: Sequence[tuple[str, Entry]], first: int, step: int
             ) -> list[tuple[int, int, list[tuple[Entry, int, int, int]]]]:
    """The file's data from byte ``first`` cut into windows of ``step`` bytes, one bounce buffer
    each: (file offset, bytes, [(entry, its first byte, bytes, where in the buffer)])."""
    spans, at = [], first
    for _, e in members:
        if e.nbytes:
            spans.append((e, at))
        at += e.nbytes
    out, i = [], 0  # one sweep: spans[i] is the first tensor not yet wholly in earlier windows
    for w in range(first, at, step):
        end = min(w + step, at)
        segs, j = [], i
        while j < len(spans) and spans[j][1] < end:
            e, a = spans[j]
            lo, hi = max(w, a), min(end, a + e.nbytes)
            segs.append((e, lo - a, hi - lo, lo - w))
            j += 1
        while i < len(spans) and spans[i][1] + spans[i][0].nbytes <= end:
            i += 1
        out.append((w, end - w, segs))
    return out


def _write_safetensors_direct(source: CheckpointSource, members: Sequence[tuple[str, Entry]], path: Path,
                              bounces: tuple[np.ndarray, np.ndarray], reader: ThreadPoolExecutor) -> None:
    """One safetensors file written straight from the checkpoint's checked bytes.

    Why not ``safetensors.torch.save_file``: it takes whole tensors and copies each into Python
    bytes before writing, so every byte went through two fresh buffers (the tensor read out of
    the checkpoint, then that copy), and on this machine a first touch of fresh memory costs
    about as much as the cold read itself (export took 4.3x a raw read of the same bytes,
    issue 33). Here the file's bytes are read, window by window (each tensor's bytes as stored,
    checked against their CRCs), into one of two reused buffers and written with ``pwrite``:
    ``reader`` reads (and checks) the next window into one buffer while this thread writes the
    last from the other (pread, the CRC and pwrite all release the GIL), so the export takes
    about the longer of reading and writing, not their sum.

    The header is padded so the data starts on a page, and the windows' whole pages go out with
    ``O_DIRECT`` (the tail and the header through the page cache): the file's gigabytes take no
    page cache, so the export neither evicts the training job's cache nor pays for fresh page
    cache (on this VM a first touch of memory freed a while ago faults in the host: the export's
    spread, issue 33). Where ``O_DIRECT`` is refused (tmpfs, some FUSE) or the buffers are not
    page-sized, the writes are buffered. The file's blocks are allocated first
    (:func:`preallocate`). A full disk is an OSError."""
    step = len(bounces[0])
    aligned = step % DIRECT_ALIGN == 0 and all(b.ctypes.data % DIRECT_ALIGN == 0 for b in bounces)
    head = _safetensors_header(members, DIRECT_ALIGN if aligned else 8)
    windows = _windows(members, len(head), step)
    size = windows[-1][0] + windows[-1][1] if windows else len(head)

    def read(i: int) -> np.ndarray:
        _, n, segs = windows[i]
        view = bounces[i % 2][:n]
        for e, start, k, at in segs:
            source.read_bytes(e, view[at:at + k], start)   # checked before it is written
        return view

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    dfd = open_direct(path) if aligned and windows and DIRECT_WRITES else None
    pending = reader.submit(read, 0) if windows else None
    try:
        preallocate(fd, size)
        pwrite_all(fd, np.frombuffer(head, dtype=np.uint8), 0)
        for i, (w, _, _) in enumerate(windows):
            assert pending is not None
            view = pending.result()
            # the next read goes into the other buffer: the one the last pwrite has finished with
            pending = reader.submit(read, i + 1) if i + 1 < len(windows) else None
            dfd = pwrite_pages(fd, dfd, view, w)  # refused after all: buffered from here on
    finally:
        if pending is not None:   # an error midway: no read may still fill a buffer after we return
            with contextlib.suppress(Exception):
                pending.result()
        os.close(fd)
        if dfd is not None:
            os.close(dfd)


def export(src: str | os.PathLike, out: str | os.PathLike, *, to: str = "hf", step: int | None = None,
           model_key: str = MODEL_KEY, with_optimizer: bool = False, dtype: str | None = None,
           rename: Sequence[str] = (), max_shard_size: str | int = DEFAULT_MAX_SHARD,
           progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Export step ``step`` (default: newest committed) of the coci checkpoint ``src`` to ``out``
    (a directory for ``hf`` and ``dcp``, a file for ``torch``). See the module docstring."""
    if to not in FORMATS:
        raise UsageError(f"--to {to!r} is not one of {FORMATS}", hint="hf: Hugging Face safetensors")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}", hint="bf16, fp16 or fp32")
    renames = names.parse_renames(rename)
    shard_limit = parse_size(max_shard_size)
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise UsageError(f"{out} exists; export never overwrites", hint="remove it or choose another OUT")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a directory", hint="create the parent directory first")
    t0 = time.perf_counter()
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    with CheckpointSource(src, step) as source:
        model = source.model(model_key)
        rest = [e for k in source.keys() if k != model_key for e in source.entries(k)] if with_optimizer else []
        plan = _names(model, rest, renames)
        cast = DTYPES.get(dtype) if dtype else None
        try:
            if to == "hf":
                files, total = _export_hf(source, model_key, plan, tmp, shard_limit, cast, progress)
            elif to == "torch":
                files, total = _export_torch(source, model_key, plan, tmp, cast, with_optimizer, progress)
            else:
                files, total = _export_dcp(source, model_key, plan, tmp, cast, progress)
            rename_durable(tmp, out)   # every file fsynced, then the directory: the one durable rule
            if to == "torch":   # one file, written under the temporary name: report the final one
                files = [out.name]
        except BaseException as exc:
            _remove(tmp)
            if isinstance(exc, CociError):
                raise type(exc)(f"export to {out} failed, nothing was left there: {exc.message}",
                                hint=exc.hint) from exc
            if isinstance(exc, Exception):   # OSError; the writers' own (SafetensorError,
                # torch.save's RuntimeError, DCP's CheckpointException) on a full disk
                raise CheckpointError(f"export to {out} failed: {str(exc)[:500]}; nothing was left at {out}",
                                      hint="free space there (or pick another OUT) and export again"
                                      ) from exc
            raise
    return ExportResult(out, to, source.step, len(plan), total, files, time.perf_counter() - t0)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _names(model: list[Entry], rest: list[Entry], renames: list) -> list[tuple[str, Entry]]:
    plan = [(export_name(e, renames), e) for e in model] + \
           [(export_name(e, renames, prefix=True), e) for e in rest]
    seen: dict[str, Entry] = {}
    for name, e in plan:
        if name in seen:
            raise UsageError(f"two tensors would both be named {name!r} ({seen[name].key}.{seen[name].path} "
                             f"and {e.key}.{e.path})", hint="add a --rename PATTERN=REPL that keeps them apart")
        seen[name] = e
    return plan


def _casts(e: Entry, cast: torch.dtype | None) -> bool:
    """Whether ``_cast`` would convert ``e``'s tensor (a floating tensor of another dtype)."""
    t = torch_dtype(e.dtype)
    return cast is not None and t.is_floating_point and t != cast


def _cast(t: torch.Tensor, e: Entry, cast: torch.dtype | None) -> torch.Tensor:
    if cast is not None and t.is_floating_point() and t.dtype != cast:
        return t.to(cast)
    return t


def _export_hf(source: CheckpointSource, model_key: str, plan: list[tuple[str, Entry]], tmp: Path,
               limit: int, cast: torch.dtype | None, progress: Callable[[int, int], None] | None
               ) -> tuple[list[str], int]:
    sizes = [nbytes_as(e, cast if e.key == model_key else None) for _, e in plan]
    shards: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(sizes):   # as transformers cuts: a tensor larger than the limit gets its own file
        if shards[-1] and filled + n > limit:
            shards.append([])
            filled = 0
        shards[-1].append(i)
        filled += n
    k = len(shards)
    files = [SAFE_SINGLE] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    tmp.mkdir()
    weight_map: dict[str, str] = {}
    done, total = 0, sum(sizes)
    # Each file's fsync runs in a helper thread (fsync releases the GIL) while the next shard is
    # read and checked: the disk writes one file back as the next is read, instead of the export
    # waiting on each (issue 33: read, write, fsync one after another took 4x a raw read). Every
    # fsync has returned before the index is written and the directory is fsynced.
    as_stored = [e.dtype in SAFE_DTYPES and not _casts(e, cast if e.key == model_key else None) for _, e in plan]
    largest = max((e.nbytes for _, e in plan), default=0)
    size = min(_BOUNCE_MAX, -(-largest // DIRECT_ALIGN) * DIRECT_ALIGN)   # whole pages: O_DIRECT
    bounces = (aligned_empty(size), aligned_empty(size)) if any(as_stored) and largest else None
    with ThreadPoolExecutor(1, thread_name_prefix="coci-export-fsync") as flusher, \
            ThreadPoolExecutor(1, thread_name_prefix="coci-export-read") as reader:
        flushed = []
        for fname, members in zip(files, shards):
            for i in members:
                weight_map[plan[i][0]] = fname
            if bounces is not None and all(as_stored[i] for i in members):
                _write_safetensors_direct(source, [plan[i] for i in members], tmp / fname, bounces, reader)
            else:   # a cast, or a dtype the direct writer does not name: through safetensors' own
                tensors: dict[str, torch.Tensor] = {}
                for i in members:
                    name, e = plan[i]
                    t = source.read(e)   # checked against its shards' CRCs before it is written
                    tensors[name] = _cast(t, e, cast if e.key == model_key else None).contiguous()
                _write_safetensors(tensors, tmp / fname)
                del tensors
            flushed.append(flusher.submit(fsync_file, tmp / fname))
            done += sum(sizes[i] for i in members)
            if progress is not None:
                progress(done, total)
        for f in flushed:
            f.result()   # an fsync's error (EIO, ENOSPC on writeback) fails the export here
    if k > 1:   # the index last: a reader that finds it finds every file it lists
        index = {"metadata": {"total_size": total, "format": "pt", "coci_step": source.step},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        fsync_file(tmp / SAFE_INDEX)
        files.append(SAFE_INDEX)
    fsync_dir(tmp)
    return files, total


def _read_all(source: CheckpointSource, plan: list[tuple[str, Entry]], model_key: str,
              cast: torch.dtype | None, progress: Callable[[int, int], None] | None
              ) -> tuple[dict[str, torch.Tensor], int]:
    out: dict[str, torch.Tensor] = {}
    total = sum(e.nbytes for _, e in plan)
    done = 0
    for name, e in plan:
        out[name] = _cast(source.read(e), e, cast if e.key == model_key else None)
        done += e.nbytes
        if progress is not None:
            progress(done, total)
    return out, sum(t.numel() * t.element_size() for t in out.values())


def _export_torch(source: CheckpointSource, model_key: str, plan: list[tuple[str, Entry]], tmp: Path,
                  cast: torch.dtype | None, with_optimizer: bool,
                  progress: Callable[[int, int], None] | None) -> tuple[list[str], int]:
    tensors, total = _read_all(source, plan, model_key, cast, progress)
    obj: dict[str, Any]
    if not with_optimizer:
        obj = tensors
    else:   # {"model": flat cleaned state dict, "<key>": that state's own tree (optimizer state_dict ...)}
        obj = {model_key: {n: t for (n, e), t in zip(plan, tensors.values()) if e.key == model_key}}
        by_leaf = {e.meta["name"]: t for (_, e), t in zip(plan, tensors.values()) if e.key != model_key}
        skel = source.manifest["skeletons"][LeafKind.REPLICATED]
        for key in skel:
            if key != model_key:
                obj[key] = unflatten(skel[key], by_leaf)
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return [], total   # the file is OUT itself once renamed (export() names it)


def _export_dcp(source: CheckpointSource, model_key: str, plan: list[tuple[str, Entry]], tmp: Path,
                cast: torch.dtype | None, progress: Callable[[int, int], None] | None) -> tuple[list[str], int]:
    import torch.distributed.checkpoint as dcp

    tensors, total = _read_all(source, plan, model_key, cast, progress)
    tmp.mkdir()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_dcp():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    except CheckpointException as exc:   # a BaseException: DCP wraps each rank's error in it
        first = next(iter(exc.failures.values()), (exc,))[0]
        raise CheckpointError(f"dcp.save failed: {str(first)[:500]}",
                              hint="free space there (or pick another OUT) and export again") from None
    fsync_dir(tmp)
    return sorted(p.name for p in tmp.iterdir()), total


@contextlib.contextmanager
def _quiet_dcp() -> Any:
    import warnings

    with warnings.catch_warnings():   # "torch.distributed is disabled, unavailable or uninitialized"
        warnings.simplefilter("ignore", UserWarning)
        yield


def describe(result: ExportResult) -> str:
    gb = result.bytes / 1e9
    return (f"exported step {result.step}: {result.tensors} tensors, {gb:.3f} GB to {result.out} "
            f"({result.format}, {len(result.files)} file(s), {result.seconds:.1f} s)")

