"""The step catalog: the one owner of the step directories of a checkpoint root.

Rank 0 of a writing :class:`~coci_hpc.checkpoint.api.CheckpointManager` lists the root ONCE
(the first time it needs to know), then keeps the list in memory and updates it as it creates,
commits, retires and discards steps, like orbax's ``CheckpointManager``. The manager holds the
directory lock (:mod:`.lock`), so no other writer changes the root behind its back; readers
that do not hold the lock (``load_latest`` of another job, ``coci-ckpt``) list afresh.

Everything that happens to a step directory is here: creation (:meth:`StepCatalog.create`),
commit bookkeeping, retention (:meth:`~StepCatalog.retain`), discarding a failed save,
rollback (:meth:`~StepCatalog.retire_abandoned`: committed steps newer than the one loaded move
to ``ROOT/abandoned/``), partial leftovers of crashed saves (:meth:`~StepCatalog.remove_partial`)
and freeing space on a full disk (:meth:`~StepCatalog.free_space`).

**Metadata operations are counted** (:data:`OPS`, :func:`metadata_ops`): every directory
listing, stat, create, rename and remove the catalog and the manifest commit make. On Lustre
each is a metadata-server round trip; a save makes a fixed number of them, independent of the
number of checkpoints kept and of the number of ranks (only rank 0 makes them).
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coci_hpc import durable
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint import perms, spare
from coci_hpc.checkpoint.lustre import IOTuning, apply_setstripe
from coci_hpc.errors import CheckpointError

ABANDONED = "abandoned"
TRASH_PREFIX = ".trash-"
SPARE_FILE = ".spare-data.h5"    # a retired step's data file, for the next save to write over (spare.py)
STAGING_PREFIX = ".survivors-"   # a survivors' save's staging (runtime/survivors.py posts into it)
STEP_RE = re.compile(r"^step_(\d{9,})$")  # a step directory
_STAGING_RE = re.compile(r"^\.survivors-(\d+)$")
TIER_STAGING_PREFIX = ".memtier-"   # a survivors' save from the memory tier (runtime/memtier.py posts into it)
_TIER_STAGING_RE = re.compile(r"^\.memtier-(\d+)$")
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "errno = 28", "errno 28",
                  "disk full")  # rawio reports short writes as "(disk full?)"


@dataclass
class MetadataOps:
    """File-system metadata operations made by this process (rank 0 makes all of a save's)."""

    listings: int = 0   # directory listings (readdir of a whole directory)
    stats: int = 0      # stat/lookup of one name (exists, is_file, is_dir)
    creates: int = 0    # mkdir, file creation
    renames: int = 0
    removes: int = 0    # unlink of a file, removal of a directory (counted once per directory)

    def total(self) -> int:
        return self.listings + self.stats + self.creates + self.renames + self.removes

    def snapshot(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total()}

    def reset(self) -> None:
        self.listings = self.stats = self.creates = self.renames = self.removes = 0


OPS = MetadataOps()
"""The process-wide counter (what ``benchmarks/scale_bench.py`` reads around a save)."""


def metadata_ops() -> dict[str, int]:
    """The counts so far: ``{"listings", "stats", "creates", "renames", "removes", "total"}``."""
    return OPS.snapshot()


def reset_metadata_ops() -> None:
    OPS.reset()


def is_no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps, or a rank's message in a CommError) is a full disk."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc) for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ------------------------------------------------------------------------------ the layout
def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``ROOT/step_<step, 9 digits>``: the directory of one checkpoint."""
    return Path(root) / f"step_{step:09d}"


def step_of(directory: str | os.PathLike) -> int | None:
    """The step a step directory's name says, or None for another name."""
    m = STEP_RE.match(Path(directory).name)
    return int(m.group(1)) if m else None


def spare_path(root: str | os.PathLike) -> Path:
    """The spare data file of ``root`` (:mod:`.spare`): not a checkpoint, never listed."""
    return Path(root) / SPARE_FILE


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    """``ROOT/.survivors-<step>``: where the survivors of a lost rank post their states."""
    return Path(root) / f"{STAGING_PREFIX}{step:09d}"


class Staging:
    """The files of one survivors' save's staging, ``ROOT/.survivors-<step>``: the survivors post
    the per-rank states they hold (one file per state, durable), the first to :meth:`claim` writes
    the step, and the claim outlives the save until the next attempt sweeps the staging
    (:meth:`StepCatalog.sweep_staging`). The catalog owns these names; the survivors only ask."""

    CLAIM = "claim"

    def __init__(self, root: str | os.PathLike, step: int) -> None:
        self.step, self.path = step, staging_dir(root, step)

    def open(self) -> Path:
        self.path.mkdir(mode=0o700, exist_ok=True)
        return self.path

    def post(self, rank: int, holder: int, blob: bytes) -> None:
        """``holder``'s copy of ``rank``'s state (``holder == rank``: the rank's own)."""
        durable.write_atomic(self.open() / f"rank{rank:05d}.from{holder:05d}", blob)

    def claim(self) -> bool:
        """Whether this process is the first to claim the step (O_EXCL create of ``claim``)."""
        try:
            os.close(os.open(self.open() / self.CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            return False

    def posted(self) -> list[tuple[int, int, bytes]]:
        """(rank, holder, blob) of every posted state, in name order."""
        out = []
        for p in sorted(self.path.glob("rank*.from*")):
            try:
                out.append((int(p.name[4:9]), int(p.name[14:19]), p.read_bytes()))
            except (ValueError, FileNotFoundError):
                continue
        return out

    def holders(self) -> set[int]:
        """The ranks that posted anything here: the survivors that reached this save (a rank that
        is lost posts nothing; one that reached it posts at least its own state)."""
        out = set()
        for p in self.path.glob("*.from*"):
            try:
                out.add(int(p.name.rsplit(".from", 1)[1][:5]))
            except ValueError:
                continue
        return out

    def absent(self, size: int) -> list[int]:
        """The ranks of a world of ``size`` that posted nothing here: lost, as far as this
        staging can tell."""
        return sorted(set(range(size)) - self.holders())

    def has_own(self, rank: int) -> bool:
        """Whether ``rank`` posted its own state (it survived)."""
        return (self.path / f"rank{rank:05d}.from{rank:05d}").exists()

    def drop_posted(self) -> None:
        """After the commit: remove the posted states, keep the claim."""
        for p in self.path.iterdir():
            if p.name != self.CLAIM:
                p.unlink(missing_ok=True)


class TierStaging(Staging):
    """The staging of a survivors' save from the memory tier after a loss at step ``boundary``,
    ``ROOT/.memtier-<boundary>``: each survivor posts every memory-tier copy it holds, named by
    the step it is of as well (the copies of one rank may be of several steps); claim, cleanup
    and sweep as for :class:`Staging`."""

    def __init__(self, root: str | os.PathLike, boundary: int) -> None:
        self.step, self.path = boundary, Path(root) / f"{TIER_STAGING_PREFIX}{boundary:09d}"

    def post_at(self, step: int, rank: int, holder: int, blob: bytes | memoryview) -> None:
        """``holder``'s copy of ``rank``'s state at ``step``."""
        durable.write_atomic(self.open() / f"step{step:09d}.rank{rank:05d}.from{holder:05d}", bytes(blob))

    def writing(self) -> bool:
        """Whether a copy is being posted right now (a durable write's temp file is there)."""
        return any(".tmp." in p.name for p in self.path.glob(".*"))

    def posted_at(self) -> dict[int, dict[int, tuple[int, Path]]]:
        """step -> rank -> (holder, file) of the posted copies (the first found of each)."""
        out: dict[int, dict[int, tuple[int, Path]]] = {}
        for p in sorted(self.path.glob("step*.rank*.from*")):
            try:
                step, rank, holder = int(p.name[4:13]), int(p.name[18:23]), int(p.name[28:33])
            except ValueError:
                continue
            out.setdefault(step, {}).setdefault(rank, (holder, p))
        return out


def is_committed(root: str | os.PathLike, step: int | None = None) -> bool:
    """One lookup, no listing: is ``step`` of ``root`` committed on disk right now (its manifest,
    written last, is there)? ``step`` None: ``root`` is itself a step directory."""
    OPS.stats += 1
    return ((Path(root) if step is None else step_dir(root, step)) / mf.MANIFEST).is_file()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """:func:`.manifest.read`, bound to the step the directory's name says (a manifest moved
    or edited into another step directory is refused)."""
    return mf.read(directory, step=step_of(directory))


def read_step(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """The validated manifest of committed ``step`` under ``root``."""
    return mf.read(step_dir(root, step), step=step)


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed: bool


def scan(root: str | os.PathLike) -> list[CheckpointInfo]:
    """A reader's fresh look (one listing): all step directories, oldest first, committed or not."""
    return StepCatalog(root).infos()


def committed_steps(root: str | os.PathLike) -> list[int]:
    """A reader's fresh look (one listing): the committed steps, oldest first."""
    return StepCatalog(root).committed()


def latest_step(root: str | os.PathLike) -> int | None:
    """A reader's fresh look (one listing): the newest committed step, or None."""
    return StepCatalog(root).latest()


# ------------------------------------------------------------------------ background deletion
_catalogs: weakref.WeakSet[StepCatalog] = weakref.WeakSet()


def _reap(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def wait_for_deletions() -> None:
    """Block until every catalog's background deletion of retired steps has finished (tests,
    benchmarks; a manager waits for its own catalog's only)."""
    for c in list(_catalogs):
        c.wait_for_deletions()


def _remove_tree(path: Path) -> None:
    OPS.removes += 1
    shutil.rmtree(path, ignore_errors=True)


def catalog_of(where: str | os.PathLike | StepCatalog) -> StepCatalog:
    """``where`` itself when it is a catalog (the manager's), else a catalog of the root ``where``
    (a tool or test with no manager in the process)."""
    return where if isinstance(where, StepCatalog) else StepCatalog(where)


class StepCatalog:
    """Rank 0's view of ``root``: {step: committed?}, listed once, then kept up to date."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._steps: dict[int, bool] | None = None
        self._staging: dict[int, Path] = {}   # survivors' staging directories seen in the listing
        self._tier_staging: list[Path] = []   # the memory tier's, likewise
        self._trash: list[Path] = []      # retired steps whose data is still being removed
        self._root_ready = False
        # This catalog's own deletion thread: one manager's close() never waits for another's.
        self._reaper: threading.Thread | None = None
        _catalogs.add(self)

    def wait_for_deletions(self) -> None:
        """Block until this catalog's background deletion of retired steps has finished."""
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None

    # ----------------------------------------------------------------------------- reading
    def _list(self) -> dict[int, bool]:
        if self._steps is None:
            self.refresh()
        assert self._steps is not None
        return self._steps

    def refresh(self) -> None:
        """List the root (one listing, plus one lookup of the manifest per step directory)."""
        OPS.listings += 1
        steps: dict[int, bool] = {}
        staging: dict[int, Path] = {}
        tier_staging: list[Path] = []
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        for e in entries:
            if not e.is_dir(follow_symlinks=False):  # d_type from the listing: no stat
                continue
            m = STEP_RE.match(e.name)
            if m:
                OPS.stats += 1
                steps[int(m.group(1))] = os.path.isfile(os.path.join(e.path, mf.MANIFEST))
            elif e.name.startswith(TRASH_PREFIX):
                self._trash.append(Path(e.path))  # a deletion a crash interrupted
            elif (st := _STAGING_RE.match(e.name)) is not None:
                staging[int(st.group(1))] = Path(e.path)
            elif _TIER_STAGING_RE.match(e.name):
                tier_staging.append(Path(e.path))
        self._steps = dict(sorted(steps.items()))
        self._staging = dict(sorted(staging.items()))
        self._tier_staging = tier_staging
        self._root_ready = bool(entries) or self.root.is_dir()

    def committed(self) -> list[int]:
        return [s for s, c in self._list().items() if c]

    def latest(self) -> int | None:
        steps = self.committed()
        return steps[-1] if steps else None

    def partial(self) -> list[int]:
        return [s for s, c in self._list().items() if not c]

    def infos(self) -> list[CheckpointInfo]:
        """Every step directory, oldest first, committed or not."""
        return [CheckpointInfo(s, step_dir(self.root, s), c) for s, c in self._list().items()]

    def torn_staging(self) -> list[int]:
        """Steps of earlier survivors' saves whose staging is still there but that did not
        commit (read only; :meth:`sweep_staging` removes the staging)."""
        steps = self._list()
        return [s for s in self._staging if not steps.get(s)]

    def sweep_staging(self) -> list[int]:
        """Remove every survivors' staging directory seen in the listing (the memory tier's
        included: :class:`TierStaging`); returns :meth:`torn_staging` as it was before."""
        torn = self.torn_staging()
        for path in [*self._staging.values(), *self._tier_staging]:
            _remove_tree(path)
        self._staging, self._tier_staging = {}, []
        return torn

    # ----------------------------------------------------------------------------- writing
    def create(self, step: int, tuning: IOTuning) -> Path:
        """Make the (empty) directory of ``step``; refuse a committed one, replace a leftover."""
        steps = self._list()
        directory = step_dir(self.root, step)
        if steps.get(step):
            raise CheckpointError(f"step {step} is already committed in {self.root}",
                                  hint="save under a new step number, or delete that checkpoint first")
        if step in steps:  # leftover of a writer that died before commit
            _remove_tree(directory)
        if not self._root_ready:
            OPS.creates += 1
            perms.make_dirs(self.root, tuning.dir_mode)   # modes from access=, not the umask
            self._root_ready = True
        OPS.creates += 1
        try:
            perms.make_dir(directory, tuning.dir_mode)
        except FileExistsError:  # the catalog missed it (someone else made it): start it afresh
            _remove_tree(directory)
            perms.make_dir(directory, tuning.dir_mode)
        steps[step] = False
        self._steps = dict(sorted(steps.items()))
        # The new entry must survive a crash before the manifest's own directory fsync: without
        # it a power loss could keep the manifest's inode but lose the step directory's name.
        durable.fsync_dir(self.root)
        apply_setstripe(tuning, directory)
        return directory

    def commit(self, step: int, manifest: dict[str, Any]) -> Path:
        """Write the manifest of ``step`` (temp name, fsync, rename, directory fsync): from
        here on the step is committed."""
        path = self.write_manifest(step, manifest)
        self.committed_now(step)
        return path

    def write_manifest(self, step: int, manifest: dict[str, Any]) -> Path:
        """The I/O of :meth:`commit` alone, without touching this catalog's listing: safe in
        another thread while the owner thread reads the catalog (the async save's commit seals
        in a thread); :meth:`committed_now` afterwards, in the owner thread."""
        OPS.creates += 1
        OPS.renames += 1
        return mf.commit(step_dir(self.root, step), manifest)

    def committed_now(self, step: int) -> None:
        """Record that :meth:`write_manifest` committed ``step``."""
        steps = self._list()
        steps[step] = True
        self._steps = dict(sorted(steps.items()))

    def discard(self, step: int) -> None:
        """Remove the directory of a save that failed (never a committed step)."""
        directory = step_dir(self.root, step)
        OPS.stats += 1
        if (directory / mf.MANIFEST).exists():  # the commit got as far as the manifest
            self._list()[step] = True
            return
        _remove_tree(directory)
        OPS.stats += 1
        if directory.exists():  # could not be removed: a partial leftover, retention retries
            self._list()[step] = False
        else:
            self._list().pop(step, None)

    def retain(self, keep: int, *, background: bool = True, recycle: bool = False) -> list[int]:
        """Delete all but the newest ``keep`` committed steps, and partial steps older than the
        newest. A victim is made uncommitted first (manifest unlinked), then renamed to
        ``.trash-...`` (both instant); a background thread removes its data. ``recycle``: a
        retired committed step's data file is kept as a spare for the next save (:mod:`.spare`).
        Returns the steps."""
        steps = self._list()
        committed = [s for s, c in steps.items() if c]
        if not committed:
            return []
        newest = committed[-1]
        keep_steps = set(committed[-max(1, keep):])
        removed = []
        for step, is_committed in list(steps.items()):
            if (is_committed and step not in keep_steps) or (not is_committed and step < newest):
                path = step_dir(self.root, step)
                if is_committed:  # manifest first: a crash midway never leaves a "committed" half
                    OPS.removes += 1
                    (path / mf.MANIFEST).unlink(missing_ok=True)
                target = self.root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}"
                OPS.renames += 1
                try:
                    os.rename(path, target)
                except OSError:
                    target = path
                if recycle and is_committed:
                    OPS.stats += 1
                    OPS.renames += spare.put(target / mf.DATA_FILE, spare_path(self.root))
                self._trash.append(target)
                del steps[step]
                removed.append(step)
        if self._trash:
            trash, self._trash = self._trash, []
            self.wait_for_deletions()
            if background:
                self._reaper = threading.Thread(target=_reap, args=(trash,), name="coci-retention", daemon=True)
                self._reaper.start()
            else:
                _reap(trash)
        return removed

    def retire_abandoned(self, base: int) -> list[int]:
        """Rollback: move committed steps newer than ``base`` to ``ROOT/abandoned/`` (renamed,
        never deleted); partial ones are removed. Returns the steps moved."""
        moved = []
        steps = self._list()
        for step, is_committed in list(steps.items()):
            if step <= base:
                continue
            path = step_dir(self.root, step)
            del steps[step]
            if not is_committed:
                _remove_tree(path)
                continue
            dest_dir = self.root / ABANDONED
            OPS.creates += 1
            dest_dir.mkdir(exist_ok=True)
            dest = dest_dir / path.name
            OPS.stats += 1
            if dest.exists():  # abandoned twice (two rollbacks past the same step): keep both
                dest = dest_dir / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}.{os.getpid()}"
            OPS.renames += 1
            os.rename(path, dest)
            moved.append(step)
        if moved:
            durable.fsync_dir(self.root)
        return moved

    def remove_partial(self) -> list[int]:
        """Delete uncommitted step directories (saves that never committed)."""
        removed = self.partial()
        for step in removed:
            _remove_tree(step_dir(self.root, step))
            del self._list()[step]
        return removed

    def free_space(self) -> list[str]:
        """A full disk: delete all abandoned checkpoints, then every committed one but the
        newest, and retired data still being removed. Returns what went."""
        freed = spare.clear(spare_path(self.root))
        abandoned = self.root / ABANDONED
        if abandoned.is_dir():
            OPS.listings += 1
            for p in sorted(abandoned.iterdir()):
                _remove_tree(p)
                freed.append(f"{ABANDONED}/{p.name}")
        for step in self.committed()[:-1]:
            path = step_dir(self.root, step)
            OPS.removes += 1
            (path / mf.MANIFEST).unlink(missing_ok=True)  # uncommitted first: a crash midway is safe
            _remove_tree(path)
            del self._list()[step]
            freed.append(path.name)
        self.wait_for_deletions()
        OPS.listings += 1
        for p in self.root.glob(f"{TRASH_PREFIX}*"):  # retention's background deletions not finished
            _remove_tree(p)
        return freed
