"""Load model weights from a pretrained checkpoint into a model of any layout.

    report = load_pretrained("/models/llama-hf", model)                 # HF safetensors directory
    load_pretrained("weights.pt", ddp_model)                            # torch.save file (weights only)
    load_pretrained("/ckpt/dcp", fsdp2_model)                           # a DCP directory
    load_pretrained("/scratch/other-run", model)                        # a coci checkpoint root

Names are matched after removing wrapper prefixes on both sides (``module.``, ``_orig_mod.``,
FSDP's; see :mod:`.names`). Every target tensor is filled in place: a plain tensor (a DDP
replica) with the whole source tensor, a DTensor (FSDP2, tensor parallel) with only its local
box, read as a slice (safetensors ``get_slice``, a slice of a memory-mapped ``torch.load``,
the rows of a coci dataset, DCP's own planner). Nothing is loaded before every name and shape
was checked: with ``strict=True`` (the default) any missing, unexpected or mismatching name
raises one :class:`~coci_hpc.errors.UsageError` listing them all; with ``strict=False`` the
matching tensors are loaded and the rest is returned (and logged by the caller).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.errors import CheckpointNotFound, UsageError
from coci_hpc.interop import names
from coci_hpc.interop.source import MODEL_KEY, CheckpointSource, export_name

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, lengths) per dim


@dataclass
class LoadReport:
    source: str
    kind: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)      # in the model, not in the source
    unexpected: list[str] = field(default_factory=list)   # in the source, not in the model
    mismatched: list[str] = field(default_factory=list)   # "name: source (a, b) vs model (c, d)"

    def problems(self) -> str:
        parts = []
        for what, xs in (("missing from the source", self.missing),
                         ("not in the model (unexpected)", self.unexpected),
                         ("shape mismatch", self.mismatched)):
            if xs:
                more = f" ... and {len(xs) - 10} more" if len(xs) > 10 else ""
                parts.append(f"{len(xs)} {what}: {', '.join(xs[:10])}{more}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "loaded": len(self.loaded),
                "missing": self.missing, "unexpected": self.unexpected, "mismatched": self.mismatched}


class _Source:
    kind = "?"

    def clean(self, name: str) -> str:
        return names.clean(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, name: str, box: Box | None) -> torch.Tensor:
        raise NotImplementedError

    def materialize(self) -> dict[str, torch.Tensor]:
        """Every tensor, whole (for an import into a coci checkpoint)."""
        return {k: self.read(k, None).contiguous() for k in self.shapes()}

    def load_all(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Fill each target with its source tensor (a DTensor target: only its local box)."""
        for name, target in pairs:
            box = _local_box(target)
            local = _local(target)
            if box is not None and math.prod(box[1]) == 0:
                continue
            data = self.read(name, box)
            with torch.no_grad():
                local.copy_(data.reshape(local.shape))  # blocking: data (host, filled) may be freed after

    def close(self) -> None:
        pass


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _local_box(t: torch.Tensor) -> Box | None:
    """This rank's box of a DTensor in global coordinates (None: a plain tensor, all of it)."""
    if not _is_dtensor(t):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return tuple(int(x) for x in offset), tuple(int(x) for x in shape)


def _slices(shape: tuple[int, ...], box: Box | None) -> tuple[slice, ...]:
    if box is None:
        return tuple(slice(0, n) for n in shape)
    return tuple(slice(o, o + n) for o, n in zip(*box))


class _Safetensors(_Source):
    """One or more safetensors files. One file is open (memory-mapped) at a time and the targets
    are filled file by file: the mapped pages a load touches are released with each file."""

    kind = "hf-safetensors"

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self._where[k] = f
                    self._shapes[k] = tuple(h.get_slice(k).get_shape())
        self._current: tuple[Path, Any] | None = None

    def _handle(self, name: str) -> Any:
        f = self._where[name]
        if self._current is None or self._current[0] != f:
            self._current = None              # the previous file's mapping goes first
            self._current = (f, self._open(str(f), framework="pt"))
        return self._current[1]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str, box: Box | None) -> torch.Tensor:
        h = self._handle(name)
        shape = self._shapes[name]
        if not shape:
            return h.get_tensor(name)
        return h.get_slice(name)[_slices(shape, box)]

    def load_all(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        order = {f: i for i, f in enumerate(dict.fromkeys(self._where.values()))}
        super().load_all(sorted(pairs, key=lambda p: order[self._where[p[0]]]))
        self.close()

    def close(self) -> None:
        self._current = None


class _TorchFile(_Source):
    kind = "torch"

    def __init__(self, path: Path, model_key: str) -> None:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:   # an old (non-zip) file cannot be mapped
            obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()) \
                and isinstance(obj.get(model_key), Mapping):
            obj = obj[model_key]     # {"model": state_dict, "optimizer": ...}
        if not isinstance(obj, Mapping):
            raise UsageError(f"{path} holds a {type(obj).__name__}, not a state dict",
                             hint="save model.state_dict() (torch.save(model.state_dict(), PATH))")
        self._t = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._t.items()}

    def read(self, name: str, box: Box | None) -> torch.Tensor:
        t = self._t[name]
        return t[_slices(tuple(t.shape), box)] if t.dim() else t


class _Coci(_Source):
    kind = "coci"

    def __init__(self, root: Path, model_key: str, step: int | None) -> None:
        self._src = CheckpointSource(root, step)
        self._e = {export_name(e, []): e for e in self._src.model(model_key)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: e.shape for k, e in self._e.items()}

    def read(self, name: str, box: Box | None) -> torch.Tensor:
        e = self._e[name]
        return self._src.read(e) if box is None else self._src.read_box(e, *box)

    def load_all(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        rest = []
        for name, target in pairs:   # straight into the target's memory where it can take it
            box = _local_box(target) or (tuple(0 for _ in target.shape), tuple(target.shape))
            if not self._src.read_box_into(self._e[name], *box, _local(target)):
                rest.append((name, target))
        super().load_all(rest)

    def close(self) -> None:
        self._src.close()


class _DCP(_Source):
    kind = "dcp"

    def __init__(self, path: Path, model_key: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.model_key = model_key
        md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self._shapes = {k: tuple(v.size) for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        self._dtypes = {k: v.properties.dtype for k, v in md.items() if isinstance(v, TensorStorageMetadata)}

    def materialize(self) -> dict[str, torch.Tensor]:
        out = {k: torch.empty(s, dtype=self._dtypes[k]) for k, s in self._shapes.items()}
        self.load_all(list(out.items()))
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def clean(self, name: str) -> str:
        # torchtitan-style DCP checkpoints nest the model under its state key: "model.fc.weight"
        prefix = f"{self.model_key}."
        if all(k.startswith(prefix) for k in self._shapes):
            name = name[len(prefix):]
        return names.clean(name)

    def load_all(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        import warnings

        import torch.distributed.checkpoint as dcp

        sd = dict(pairs)   # DCP's planner reads each DTensor's local box itself, in place
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(self.path)))


def open_source(path: str | os.PathLike, *, model_key: str = MODEL_KEY, step: int | None = None) -> _Source:
    """The pretrained checkpoint at ``path``, whatever its format."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".safetensors":
            return _Safetensors([p])
        return _TorchFile(p, model_key)
    if not p.is_dir():
        raise CheckpointNotFound(f"init_from {p} does not exist",
                                 hint="pass a Hugging Face directory, a torch.save file or a DCP directory")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{index} is not a safetensors index: {exc}", hint="re-export it") from exc
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise CheckpointNotFound(f"{index} lists {missing[0]}, which is not there",
                                     hint="the export is incomplete; export or download it again")
        return _Safetensors([p / f for f in files])
    singles = sorted(p.glob("*.safetensors"))
    if singles:
        return _Safetensors(singles)
    if (p / ".metadata").is_file():
        return _DCP(p, model_key)
    if cat.is_committed(p) or cat.latest_step(p) is not None:
        return _Coci(p, model_key, step)   # a root, or one step directory of it
    raise UsageError(f"{p} holds no model weights coci can read",
                     hint="expected *.safetensors (+ model.safetensors.index.json), a DCP directory "
                          "(.metadata), a torch.save file or a coci checkpoint")


def target_tensors(target: Any) -> dict[str, torch.Tensor]:
    """{state-dict name: tensor} of a module (``state_dict()``) or of a dict of tensors."""
    sd = target.state_dict() if isinstance(target, torch.nn.Module) else target
    if not isinstance(sd, Mapping):
        raise UsageError(f"cannot load weights into a {type(target).__name__}",
                         hint="pass the model (an nn.Module) or its state dict")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def load_pretrained(path: str | os.PathLike, target: Any, *, strict: bool = True,
                    model_key: str = MODEL_KEY, step: int | None = None,
                    log: Callable[[str], None] | None = None) -> LoadReport:
    """Fill ``target`` (a model or a state dict, any layout) with the weights at ``path``."""
    src = open_source(path, model_key=model_key, step=step)
    try:
        have = {src.clean(k): (k, s) for k, s in src.shapes().items()}
        targets = target_tensors(target)
        report = LoadReport(os.fspath(path), src.kind)
        pairs: list[tuple[str, torch.Tensor]] = []
        for tname, t in targets.items():
            cname = names.clean(tname)
            if cname not in have:
                report.missing.append(tname)
                continue
            sname, shape = have[cname]
            if tuple(shape) != tuple(t.shape):
                report.mismatched.append(f"{tname}: source {tuple(shape)} vs model {tuple(t.shape)}")
                continue
            pairs.append((sname, t))
            report.loaded.append(tname)
        used = {names.clean(k) for k in targets}
        report.unexpected = sorted(k for c, (k, _) in have.items() if c not in used)
        if strict and (report.missing or report.unexpected or report.mismatched):
            raise UsageError(f"the weights at {path} do not fit the model: {report.problems()}",
                             hint="fix the names (export with --rename), or pass strict=False "
                                  "(init_strict=False) to load what matches")
        src.load_all(pairs)
        if log is not None and (report.missing or report.unexpected or report.mismatched):
            log(f"init_from {path}: loaded {len(report.loaded)} tensors; not loaded: {report.problems()}")
        return report
    finally:
        src.close()


def init_state_from(state: Mapping[str, Any], path: str | os.PathLike, *, strict: bool, resumed: int | None,
                    log: Callable[[str], None] | None) -> LoadReport | None:
    """The Session's ``init_from``: pretrained weights into ``state["model"]`` (every rank; ``log``
    given on rank 0 only), unless the run ``resumed`` from a checkpoint of its own (then ignored)."""
    if resumed is not None:
        if log is not None:
            log(f"init_from={os.fspath(path)} ignored: resumed from this run's own checkpoint step {resumed}")
        return None
    if "model" not in state:
        raise UsageError("init_from needs the model under the state key 'model'",
                         hint="pass Session({'model': model, ...}, init_from=PATH)")
    report = load_pretrained(path, state["model"], strict=strict, log=log)
    if log is not None:
        log(f"init_from: loaded {len(report.loaded)} tensors from {report.source} ({report.kind})")
    return report


def import_to_checkpoint(src: str | os.PathLike, out: str | os.PathLike, *, step: int = 0,
                         model_key: str = MODEL_KEY) -> dict[str, Any]:
    """Write the weights at ``src`` as step ``step`` of a new coci checkpoint under ``out``,
    holding ``{model_key: {name: tensor}}`` (names cleaned of wrapper prefixes). A run then
    starts from it with ``init_from=out``. Holds the model in memory once."""
    from coci_hpc.checkpoint import CheckpointManager

    out_p = Path(out)
    if out_p.exists() and (not out_p.is_dir() or cat.scan(out_p)):
        raise UsageError(f"{out_p} exists and is not an empty checkpoint directory; import never overwrites",
                         hint="choose a new OUT directory")
    source = open_source(src, model_key=model_key)
    try:
        raw = source.materialize()
    finally:
        source.close()
    tensors: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        name = source.clean(k)
        if name in tensors:
            raise UsageError(f"{src}: two tensors are both named {name!r} once wrapper prefixes are removed",
                             hint="import a checkpoint saved without the wrapper")
        tensors[name] = t
    mgr = CheckpointManager(out_p, keep=1, rng=False)
    try:
        mgr.save(step, {model_key: tensors})
    finally:
        mgr.close()
    return {"src": os.fspath(src), "out": os.fspath(out_p), "kind": source.kind, "step": step,
            "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
