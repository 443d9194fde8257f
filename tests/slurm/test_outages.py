"""Outages that end every job, as Slurm's history shows them (the two-tier plan's whole-job rate)."""
import time
from datetime import datetime

import pytest

from coci_hpc.errors import UsageError
from coci_hpc.planner import two_tier as tt
from coci_hpc.slurm import accounting as acct
from coci_hpc.slurm.failure_input import FailureInput, failure_model

SACCT_HEAD = "JobIDRaw|JobID|Partition|State|Start|End|NNodes|NodeList\n"
EVENTS_HEAD = "NodeName|TimeStart|TimeEnd|State|Reason\n"


def ts(s):
    return time.mktime(datetime.strptime(s, "%Y-%m-%dT%H:%M:%S").timetuple())


def _model(sacct="", events="", nodes=8):
    hist = acct.History()
    if sacct:
        hist = hist.merge(acct.parse_sacct(SACCT_HEAD + sacct))
    if events:
        hist = hist.merge(acct.parse_events(EVENTS_HEAD + events))
    return acct.build_model(hist, ts("2026-11-01T00:00:00"), ts("2026-11-21T00:00:00"), cluster_nodes=nodes,
                            have_events=bool(events))


def test_several_jobs_ending_node_fail_in_one_minute_are_an_outage():
    jobs = ("1|1|p|COMPLETED|2026-11-01T00:00:00|2026-11-20T00:00:00|2|n[1-2]\n"
            "2|2|p|NODE_FAIL|2026-11-10T00:00:00|2026-11-12T10:00:05|2|n[3-4]\n"
            "3|3|p|NODE_FAIL|2026-11-10T00:00:00|2026-11-12T10:00:40|1|n5\n"
            # one job alone: one node of it died, not an outage
            "4|4|p|NODE_FAIL|2026-11-10T00:00:00|2026-11-15T00:00:00|4|n[5-8]\n"
            # two jobs in a minute on the same node: one node
            "5|5|p|NODE_FAIL|2026-11-16T00:00:00|2026-11-17T00:00:00|1|n6\n"
            "6|6|p|NODE_FAIL|2026-11-16T00:00:00|2026-11-17T00:00:20|2|n[6-7]\n")
    model, summary = _model(sacct=jobs)
    assert summary["outages"] == 1 and len(model.outage_times) == 1
    assert model.outage_window_s == pytest.approx(20 * 86400.0)
    prof = tt.profile_from_model(model, 4)
    assert prof.outage_rate == pytest.approx(1 / (20 * 86400.0))
    assert "1 outage(s) in 480 h" in prof.whole_job_note


def test_a_partition_wide_event_is_an_outage_and_a_node_event_is_not():
    ev = ("n1|2026-11-05T10:00:00|2026-11-05T11:00:00|DOWN|Not responding\n"
          + "".join(f"n{i}|2026-11-12T03:00:{10 + i:02d}|2026-11-12T05:00:00|DOWN|power\n" for i in range(1, 6))
          + "n7|2026-11-18T10:00:00|2026-11-18T11:00:00|DOWN|Not responding\n")
    model, summary = _model(events=ev, nodes=8)
    assert summary["incidents"] == 3 and summary["outages"] == 1
    prof = tt.profile_from_model(model, 4)
    assert prof.outage_rate == pytest.approx(1 / (20 * 86400.0))
    # the outage is counted once: the two one-node incidents are what is left as incidents
    assert prof.partner_loss == 0.0


def test_a_history_without_outages_keeps_the_prior():
    ev = "n1|2026-11-05T10:00:00|2026-11-05T11:00:00|DOWN|Not responding\n"
    model, summary = _model(events=ev)
    assert summary["outages"] == 0
    prof = tt.profile_from_model(model, 4)
    assert prof.outage_rate == pytest.approx(1 / (160 * 3600.0))
    assert "no outage in 480 h of history" in prof.whole_job_note


def test_a_sacct_file_with_no_job_records_names_the_option(tmp_path):
    f = tmp_path / "empty_sacct.txt"
    f.write_text(SACCT_HEAD)
    with pytest.raises(UsageError, match="--sacct-file") as e:
        failure_model(FailureInput(sacct_file=str(f), since="2026-11-01", until="2026-11-21"), time.time())
    assert "no job records" in str(e.value)
