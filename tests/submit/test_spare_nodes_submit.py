"""What `coci-submit --spare-nodes` renders and asks submitit for (N+K nodes, --no-kill, the
relaunch loop in the batch shell, not srun); the loop itself is tested in tests/runtime/test_relaunch.py."""
from __future__ import annotations

import pytest

from coci_hpc.cli.submit import main as submit_main
from coci_hpc.errors import UsageError
from coci_hpc.submit.spec import build_spec, executor_parameters


def test_spec_asks_for_n_plus_k_nodes_without_srun(tmp_path) -> None:
    spec = build_spec(script="t.py", script_args=[], cwd=tmp_path, python="python", nodes=2, spare_nodes=1,
                      max_restarts=5)
    p = executor_parameters(spec)
    assert p["nodes"] == 3 and p["use_srun"] is False and p["additional_parameters"]["no-kill"] is True
    plain = executor_parameters(build_spec(script="t.py", script_args=[], cwd=tmp_path, python="python", nodes=2))
    assert plain["nodes"] == 2 and "use_srun" not in plain and "no-kill" not in plain["additional_parameters"]
    with pytest.raises(UsageError, match="--spare-nodes cannot be combined with --array"):
        build_spec(script="t.py", script_args=[], cwd=tmp_path, python="python", spare_nodes=1, array="2")
    with pytest.raises(UsageError, match="--spare-nodes -1"):
        build_spec(script="t.py", script_args=[], cwd=tmp_path, python="python", spare_nodes=-1)


def test_dry_run_shows_spare_nodes_and_the_relaunch_loop(fake_slurm, capsys) -> None:
    assert submit_main(["--nodes", "2", "--spare-nodes", "1", "--max-restarts", "4", "--dry-run",
                        "train.py", "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in out and "#SBATCH --no-kill" in out and "#SBATCH --requeue" in out
    assert "srun --no-kill --nodes=2" in out and "--max-restarts 4" in out
    assert "\nsrun " not in out and "submitit.core._submit" in out  # the loop, not srun, runs submitit's runner
