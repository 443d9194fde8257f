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


def test_each_default_is_one_value_and_the_text_is_formatted_from_it() -> None:
    """The defaults the table states (peer deadline, memory tier interval, collective timeout, the
    whole-job priors, the policy) are settings' values: the modules that use them hold the same
    object, and the table's and the options' text changes with the value."""
    from coci_hpc.cli import plan as cli_plan
    from coci_hpc.cli import submit as cli_submit
    from coci_hpc.planner import whole_job
    from coci_hpc.runtime import distributed, memtier, stepsync

    assert stepsync.MIN_DEADLINE_S == settings.PEER_TIMEOUT_S and stepsync.DEADLINE_STEPS == settings.PEER_TIMEOUT_STEPS
    assert memtier.DEFAULT_EVERY == settings.MEMTIER_EVERY
    assert distributed.DEFAULT_TIMEOUT_S == settings.DIST_TIMEOUT.default == settings.DIST_TIMEOUT_S
    assert whole_job.DEFAULT_SHARE == settings.WHOLE_JOB_SHARE_PRIOR
    assert whole_job.DEFAULT_OUTAGE_HOURS == settings.OUTAGE_HOURS_PRIOR
    assert settings.POLICY.default == settings.POLICY_DEFAULT
    table = settings.markdown_table()
    assert f"| {settings.PEER_TIMEOUT_S:g} s (and at least {settings.PEER_TIMEOUT_STEPS:g} typical steps) |" in table
    assert f"| {settings.MEMTIER_EVERY}, then planned |" in table and f"| {settings.DIST_TIMEOUT_S:g} s |" in table
    sub = cli_submit._parser().parse_args([])
    assert (sub.policy, sub.max_requeues, sub.no_progress_limit) == \
        (settings.POLICY_DEFAULT, settings.MAX_REQUEUES_SUBMIT, settings.NO_PROGRESS_LIMIT)
    helps = " ".join(a.help or "" for a in cli_plan._parser()._actions)
    assert f"{settings.WHOLE_JOB_SHARE_PRIOR:g}, SCR's" in helps and f"1/{settings.OUTAGE_HOURS_PRIOR:g}" in helps
