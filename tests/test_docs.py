"""The documentation: README's links resolve, the docs' runnable code blocks run, and help() on the
public API documents every parameter (the reference pages are generated from those docstrings).

A fenced block is runnable when the line before its opening fence is ``<!-- run -->``; ``bash``
blocks run under ``bash -euo pipefail`` with the venv's tools on PATH, ``python`` blocks in a fresh
interpreter, both from the repository root with this checkout first on PYTHONPATH. Keep them quick
and free of side effects. ``mkdocs build --strict`` itself runs in tests/run.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^<!-- run -->\n```(\w+)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def runnable_blocks() -> list[tuple[str, str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for m in FENCE.finditer(page.read_text()):
            found.append((str(page.relative_to(ROOT)), m.group(1), m.group(2)))
    return found


BLOCKS = runnable_blocks()


def test_the_docs_have_runnable_blocks() -> None:
    assert len(BLOCKS) >= 3, "mark the docs' quick, side-effect-free examples with <!-- run -->"


@pytest.mark.parametrize(("page", "lang", "code"), BLOCKS, ids=[f"{p}#{i}" for i, (p, _, _) in enumerate(BLOCKS)])
def test_runnable_block(page: str, lang: str, code: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               MPLBACKEND="Agg")
    if lang in ("bash", "sh"):
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    elif lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        pytest.fail(f"{page}: a runnable block must be bash or python, not {lang!r}")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}: exit {done.returncode}\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:|#", t)]
    assert targets, "README links to its documentation"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_readme_is_short_and_keeps_the_entry_points() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for command in ("bash tests/run", "bash examples/demo.sh", "slurm/setup --python-only"):
        assert command in text, f"README.md no longer states {command!r}"


# The API the reference pages render from docstrings (imported in the test, not at collection).
PUBLIC_API = ["coci_hpc.session:Session", "coci_hpc.checkpoint.api:CheckpointManager",
              "coci_hpc.runtime.schedule:CheckpointSchedule", "coci_hpc.runtime.distributed:init_distributed"]


def _args_section(doc: str) -> str:
    m = re.search(r"^\s*Args:\n(.*?)(?:^\s*(?:Returns|Yields|Raises|Examples?):|\Z)", doc, re.S | re.M)
    return m.group(1) if m else ""


@pytest.mark.parametrize("where", PUBLIC_API)
def test_help_documents_every_parameter(where: str) -> None:
    module, name = where.split(":")
    obj = getattr(importlib.import_module(module), name)
    func = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    doc = inspect.getdoc(obj) or ""
    names = [n for n in inspect.signature(func).parameters if n != "self"]
    args = _args_section(doc)
    undocumented = [n for n in names if not re.search(rf"^\s+{re.escape(n)}( \(.*?\))?:", args, re.M)]
    assert not undocumented, f"{obj.__name__}'s docstring has no Args: entry for {undocumented}"


def test_every_coci_variable_is_in_the_configuration_table() -> None:
    # A COCI_* name inside a string or a shell expansion is an environment variable (a bare
    # identifier such as the planner's COCI_TIME_UNIT_S constant is not).
    used = re.compile(r"""(?:["'{$]|``)(COCI_[A-Z0-9_]+)""")
    found: set[str] = set()
    for folder in ("coci_hpc", "slurm", "examples", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and (path.suffix in (".py", ".sh", ".sbatch") or path.name in ("setup", "devcluster", "run")):
                found |= set(used.findall(path.read_text(errors="replace")))
    table = (DOCS / "reference" / "configuration.md").read_text()
    missing = sorted(v for v in found if f"`{v}`" not in table)
    assert len(found) > 20 and not missing, f"add to docs/reference/configuration.md: {missing}"
