"""Every coci-* command reports bad usage the same way: through cli.common (exit 2, `PROG: error:`
and a `PROG: hint:` line), never argparse's own exit with a bare usage line."""
from __future__ import annotations

import pytest

from coci_hpc.cli import ckpt, plan, status, submit


@pytest.mark.parametrize("main,prog,argv", [
    (ckpt.main, "coci-ckpt", []),                              # no subcommand
    (ckpt.main, "coci-ckpt", ["verify", "/tmp", "notastep"]),  # a subcommand's bad argument
    (ckpt.main, "coci-ckpt", ["frobnicate"]),
    (plan.main, "coci-plan", ["--no-such-option"]),
    (status.main, "coci-status", ["--no-such-option"]),
    (submit.main, "coci-submit", ["--nodes", "two", "train.py"]),
])
def test_bad_usage_is_a_usage_error(main, prog, argv, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}") and ": error: " in err and f"{prog}: hint: see {prog}" in err, err


@pytest.mark.parametrize("extra,pattern", [
    (["--cluster-nodes", "64"], "--cluster-nodes is for --sacct-file/--events-file"),
    (["--until", "2026-02-01"], "--until is for --sacct-file/--events-file"),
])
def test_coci_plan_from_cluster_refuses_the_options_it_would_ignore(extra, pattern, capsys) -> None:
    # refused before any Slurm command runs (none is needed to see the contradiction)
    assert plan.main(["--from-cluster", "--since", "2026-01-01", *extra]) == 2
    assert pattern in capsys.readouterr().err


def test_coci_plan_cluster_nodes_must_be_positive(tmp_path, capsys) -> None:
    f = tmp_path / "sacct.txt"
    f.write_text("")
    assert plan.main(["--sacct-file", str(f), "--cluster-nodes", "0"]) == 2
    assert "--cluster-nodes 0 must be at least 1" in capsys.readouterr().err
