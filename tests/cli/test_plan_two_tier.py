"""coci-plan --two-tier: both intervals and every alternative's expected waste."""
import json
import os

import pytest

from coci_hpc.cli import plan as cli

EVENTS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slurm", "events_edge.txt")
BASE = ["--ckpt-cost", "40", "--restart-cost", "230", "--step-time", "5", "--horizon", "72h",
        "--two-tier", "--memory-copy-s", "1", "--memory-restart-cost", "90"]


def test_json_has_both_intervals_and_alternatives(capsys):
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["two_tier"]
    assert d["tier"] == "two-tier" and d["mem_every_steps"] >= 1
    assert d["disk_every_steps"] > d["mem_every_steps"]
    assert d["mem_interval_s"] == pytest.approx(5 * d["mem_every_steps"])
    alts = d["alternatives"]
    assert {"daly", "two-tier-first-order"} <= set(alts)
    chosen = alts[d["params"]["chosen"]]["simulated_waste"]
    assert chosen <= alts["daly"]["simulated_waste"]


def test_one_node_drops_the_memory_tier_and_says_why(capsys):
    assert cli.main(["--events-file", EVENTS, "--nodes", "1", *BASE]) == 0
    out = capsys.readouterr().out
    assert "memory tier dropped" in out and "one node" in out
    assert "daly" in out and "simulated" in out


@pytest.mark.parametrize("args,needle", [
    (["--two-tier", "--step-time", "5"], "--memory-copy-s"),
    (["--two-tier", "--memory-copy-s", "1"], "step time"),
    (["--two-tier", "--step-time", "5", "--memory-copy-s", "-2"], "--memory-copy-s"),
])
def test_two_tier_usage_errors(capsys, args, needle):
    assert cli.main(["--mtbf-hours", "100", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("coci-plan: error:")
