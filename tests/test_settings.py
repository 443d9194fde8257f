"""One table of COCI_* variables (coci_hpc/settings.py): the doc's table is generated from it, and
no module of coci_hpc spells a COCI_* name the table lacks (issue 22)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import coci_hpc
from coci_hpc import settings
from coci_hpc.runtime import config

ROOT = Path(coci_hpc.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "reference" / "configuration.md"
# Test-only fault injection (COCI_FAULT_*, being moved out of production code) and the Lustre fake
# (COCI_FORCE_FSTYPE): listed by hand in the doc's test-only table.
TEST_ONLY = ("FAULT", "FORCE")


def test_doc_table_is_the_code_table() -> None:
    text = DOC.read_text()
    begin = text.index("-->\n", text.index("<!-- settings-table")) + 4
    assert text[begin:text.index("\n<!-- /settings-table -->")] == settings.markdown_table(), \
        "regenerate the table with settings.markdown_table()"


def test_every_coci_name_in_the_package_is_in_the_table() -> None:
    spelled = set()
    for f in ROOT.rglob("*.py"):
        # a quoted name: an environment variable (COCI_TIME_UNIT_S, a constant, is not one)
        spelled |= {m for m in re.findall(r"[\"'`](COCI_[A-Z0-9_]*[A-Z0-9])", f.read_text())
                    if m.split("_")[1] not in TEST_ONLY}
    assert spelled - set(settings.BY_NAME) == set()
    assert len(settings.BY_NAME) == len(settings.VARS)


def test_the_session_config_reads_the_table() -> None:
    for field, (name, parse, default) in config._FIELDS.items():
        v = settings.BY_NAME[name]
        assert (parse, default) == (v.parse, v.default), field
    assert settings.SIGNAL_LEAD.get({"COCI_SIGNAL_LEAD_S": "45"}) == 45.0
    assert settings.SIGNAL_LEAD.get({"COCI_SIGNAL_LEAD_S": ""}) is None
    with pytest.raises(ValueError, match="COCI_NO_PROGRESS_LIMIT='-1'"):
        settings.NO_PROGRESS.get({"COCI_NO_PROGRESS_LIMIT": "-1"})


def test_shared_defaults_are_spelled_once() -> None:
    from coci_hpc.cli import submit as cli_submit
    from coci_hpc.runtime import attempts, relaunch
    from coci_hpc.submit import spec

    assert cli_submit.DEFAULT_SIGNAL_LEAD == attempts.DEFAULT_SIGNAL_LEAD_S == settings.SIGNAL_LEAD_S
    assert relaunch.DEFAULT_MAX_RESTARTS == spec.SubmitSpec.max_restarts == settings.MAX_RESTARTS
    # and no module writes the number itself next to those names
    for f in ROOT.rglob("*.py"):
        if f.name == "settings.py":
            continue
        text = f.read_text()
        assert not re.search(r"(signal_lead|SIGNAL_LEAD\w*)\s*(:\s*\w+\s*)?=\s*90\b", text), f
        assert not re.search(r"(max_restarts|MAX_RESTARTS)\s*(:\s*\w+\s*)?=\s*3\b", text), f
