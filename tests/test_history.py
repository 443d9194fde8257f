"""coci-status on a made-up event log (the contract's records) and a fake sacct: text, JSON, PNG."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coci_hpc import history
from coci_hpc.cli.status import main

T0 = 1_795_000_000.0


def _rec(event: str, attempt: int, wall: float, job: str | None = "77", **kw) -> dict:
    return {"v": 1, "event": event, "wall": T0 + wall, "attempt": attempt, "job_id": job, **kw}


def _losses(a: int, wall: float, lo: int, hi: int) -> dict:
    steps = list(range(lo + 1, hi + 1))  # the Session logs the number of steps done
    return _rec("losses", a, wall, steps=steps, values=[2.0 * math.exp(-s / 150) + 0.1 for s in steps])


def story() -> list[dict]:
    """Preempted at 120 (saved), node failure at 260 (last checkpoint 250), time limit at 330, done at 400."""
    none = {"reason": "none", "source": "none", "detail": "first attempt"}

    def lat(tot, rq, ps, rs):
        return {"total": tot, "slurm_requeue_s": rq, "process_start_s": ps, "restore_s": rs}

    return [
        _rec("attempt_start", 1, 0, nodes=["n1", "n2"], ranks=2, policy="fixed:50", restart_count=0,
             prev_end=none, resumed_step=None, steps_lost=None),
        _rec("checkpoint", 1, 10, step=50, kind="planned", blocking_s=0.02, persist_s=0.1),
        _rec("checkpoint", 1, 20, step=100, kind="planned", blocking_s=0.02, persist_s=0.1),
        _losses(1, 25, 0, 120),
        _rec("checkpoint", 1, 25, step=120, kind="stop", blocking_s=0.03, persist_s=None),
        _rec("stop", 1, 25, step=120, reason="preemption", signal="SIGUSR2", requeued=True, detail=""),
        _rec("attempt_start", 2, 50, nodes=["n1", "n2"], ranks=2, policy="fixed:50", restart_count=1,
             prev_end={"reason": "preemption", "source": "session", "detail": "stopped at step 120"},
             resumed_step=120, steps_lost=0),
        _rec("resumed", 2, 53, step=120, restart_latency_s=lat(28.0, 22.0, 4.5, 1.5)),
        _rec("checkpoint", 2, 60, step=150, kind="planned", blocking_s=0.02, persist_s=0.1),
        _rec("checkpoint", 2, 70, step=200, kind="planned", blocking_s=0.02, persist_s=0.1),
        _rec("checkpoint", 2, 80, step=250, kind="planned", blocking_s=0.02, persist_s=0.1),
        _losses(2, 80, 120, 260),
        _rec("attempt_start", 3, 120, nodes=["n1", "n3"], ranks=2, policy="fixed:50", restart_count=2,
             prev_end={"reason": "node_failure", "source": "sacct", "detail": "NODE_FAIL"},
             resumed_step=250, steps_lost=10),
        _rec("resumed", 3, 124, step=250, restart_latency_s=lat(40.0, 35.0, 3.5, 1.5)),
        _losses(3, 140, 250, 330),
        _rec("checkpoint", 3, 140, step=330, kind="stop", blocking_s=0.03, persist_s=None),
        _rec("stop", 3, 140, step=330, reason="time_limit", signal="SIGUSR2", requeued=True, detail=""),
        _rec("attempt_start", 4, 170, nodes=["n1", "n2"], ranks=2, policy="fixed:50", restart_count=3,
             prev_end={"reason": "time_limit", "source": "session", "detail": "stopped at step 330"},
             resumed_step=330, steps_lost=0),
        _rec("resumed", 4, 173, step=330, restart_latency_s=lat(30.0, 25.0, 3.0, 2.0)),
        _losses(4, 190, 330, 400),
        _rec("checkpoint", 4, 190, step=400, kind="final", blocking_s=0.03, persist_s=0.1),
        _rec("end", 4, 190, step=400, status="completed", message="done"),
    ]


def _t(wall: float) -> str:
    """sacct's local time of T0 + wall."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + wall))


SACCT = "\n".join([
    f"77|PREEMPTED|{_t(-2)}|{_t(26)}|n[1-2]",
    f"77|NODE_FAIL|{_t(48)}|{_t(100)}|n[1-2]",
    f"77|TIMEOUT|{_t(118)}|{_t(141)}|n[1,3]",
    f"77|COMPLETED|{_t(168)}|{_t(191)}|n[1-2]",
]) + "\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in story())
    (d / "events.jsonl").write_text(text + '{"v": 1, "event": "loss')   # a torn last line is skipped
    return d


def test_build_classifies_each_attempt_end(run_dir: Path) -> None:
    seen = []
    h = history.load(run_dir, runner=lambda argv: seen.append(argv) or SACCT)
    assert seen and seen[0][0] == "sacct" and "77" in seen[0]
    assert [a.ended for a in h.attempts] == ["preemption", "node_failure", "time_limit", "completed"]
    assert [a.sacct_state for a in h.attempts] == ["PREEMPTED", "NODE_FAIL", "TIMEOUT", "COMPLETED"]
    assert [a.steps_lost for a in h.attempts] == [None, 0, 10, 0] and h.steps_lost_total == 10
    assert [a.last_step for a in h.attempts] == [120, 260, 330, 400]
    assert h.status == "completed" and h.final_step == 400
    assert [c["kind"] for c in h.checkpoints].count("stop") == 2
    assert h.attempts[2].restart_latency_s == {"total": 40.0, "slurm_requeue_s": 35.0,
                                               "process_start_s": 3.5, "restore_s": 1.5}


def test_the_plot_reads_the_typed_reason_not_the_display_string(run_dir: Path) -> None:
    """An interruption's reason is the attempt's typed end_reason (issue 36: the plot used to split
    ``ended``, a display string, at its first space); the JSON keeps its fields."""
    h = history.load(run_dir, use_sacct=False)
    assert [a.end_reason for a in h.attempts] == ["preemption", "node_failure", "time_limit", "completed"]
    h.attempts[0].ended = "anything shown (for people)"
    assert [m.reason for m in history.interruptions(h)] == ["preemption", "node_failure", "time_limit"]
    assert all("end_reason" not in a and "ended" in a for a in h.to_dict()["attempts"])


def test_text_json_and_png(run_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history.commands, "run_command", lambda argv, timeout=60.0: SACCT)
    png = run_dir / "h.png"
    assert main([str(run_dir), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "4 attempt(s), job(s) 77, status completed at step 400" in out
    rows = [ln for ln in out.splitlines() if ln[:3].strip().isdigit()]
    assert len(rows) == 4
    assert "node_failure [sacct]" in rows[1] and "NODE_FAIL" in rows[1]
    assert rows[2].split()[4:11] == ["250", "10", "40.0", "35.0", "3.5", "1.50", "330"]
    assert "checkpoints: 8 (final 1, planned 5, stop 2)" in out and "steps lost in total: 10" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main([str(run_dir), "--json", "--no-png"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [a["ended"] for a in d["attempts"]] == ["preemption", "node_failure", "time_limit", "completed"]
    assert d["steps_lost_total"] == 10 and len(d["losses"]["steps"]) == 400 + 10
    assert d["plot"] is None


def test_sacct_unavailable_is_said(run_dir: Path) -> None:
    from coci_hpc.errors import SlurmError

    def down(argv):
        raise SlurmError("`sacct` not found on PATH")
    h = history.load(run_dir, runner=down)
    assert h.sacct_note == "sacct unavailable: `sacct` not found on PATH"
    assert [a.ended for a in h.attempts] == ["preemption", "node_failure", "time_limit", "completed"]
    assert "sacct: sacct unavailable" in history.render_text(h)


def test_no_event_log(tmp_path: Path, capsys) -> None:
    (tmp_path / "task3").mkdir()
    (tmp_path / "task3" / "events.jsonl").write_text("")
    assert main([str(tmp_path), "--no-sacct"]) == 2
    err = capsys.readouterr().err
    assert "no event log" in err and "array run" in err and "task3" in err


# -- issue 12, item 11 ------------------------------------------------------------------------------
def test_attempts_are_matched_to_sacct_rows_by_time(run_dir: Path) -> None:
    # An attempt that died before its Session wrote anything (FAILED at 30-40 s) sits between the
    # first and second logged attempts: by position every later attempt would get its neighbour's row.
    rows = SACCT.splitlines()
    extra = "\n".join([rows[0], f"77|FAILED|{_t(30)}|{_t(40)}|n[1-2]", *rows[1:]]) + "\n"
    h = history.load(run_dir, runner=lambda argv: extra)
    assert [a.sacct_state for a in h.attempts] == ["PREEMPTED", "NODE_FAIL", "TIMEOUT", "COMPLETED"]


def test_array_tasks_are_asked_as_sacct_knows_them(tmp_path: Path) -> None:
    # SLURM_JOB_ID of an array task (91) is not what `sacct -j` lists (90_1): ask for the A_T id.
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    (tmp_path / "events.jsonl").write_text(json.dumps(_rec("attempt_start", 1, 0, job="91", slurm_id="90_1",
                                                           prev_end=none, nodes=["n1"], ranks=1)) + "\n"
                                           + json.dumps(_rec("end", 1, 30, job="91", step=60,
                                                             status="completed", message="")) + "\n")
    asked = []

    def sacct(argv):
        asked.append(argv[argv.index("-j") + 1])
        return f"90_1|COMPLETED|{_t(-1)}|{_t(31)}|n1\n" if "90_1" in argv else ""
    h = history.load(tmp_path, runner=sacct)
    assert asked == ["90_1"] and h.attempts[0].sacct_state == "COMPLETED"


def test_a_cancelled_run_is_not_running(tmp_path: Path) -> None:
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    (tmp_path / "events.jsonl").write_text(
        json.dumps(_rec("attempt_start", 1, 0, prev_end=none, nodes=["n1"], ranks=1)) + "\n"
        + json.dumps(_losses(1, 20, 0, 40)) + "\n")
    h = history.load(tmp_path, runner=lambda argv: f"77|CANCELLED by 0|{_t(-1)}|{_t(25)}|n1\n")
    assert h.status == "cancelled" and h.attempts[0].ended == "cancelled"
    assert history.load(tmp_path, runner=lambda argv: f"77|RUNNING|{_t(-1)}|Unknown|n1\n").status == "running"


def test_the_table_is_printed_when_the_png_cannot_be_written(run_dir: Path, capsys) -> None:
    assert main([str(run_dir), "--no-sacct", "--plot", "/proc/no-such-dir/history.png"]) == 0
    out, err = capsys.readouterr()
    assert "4 attempt(s), job(s) 77, status completed at step 400" in out
    assert "loss plot not written to /proc/no-such-dir/history.png" in err and "another --plot" in err


def test_an_exception_in_the_users_loop_is_the_attempts_end(tmp_path: Path) -> None:
    script = ("import torch, coci_hpc\n"
              "m = torch.nn.Linear(2, 1)\n"
              f"s = coci_hpc.Session({{'model': m}}, 50, ckpt_dir={str(tmp_path)!r}, policy='fixed:10')\n"
              "for step in s.steps():\n"
              "    if step == 12:\n"
              "        raise ValueError('bad batch at 12')\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert p.returncode == 1 and "bad batch at 12" in p.stderr
    h = history.load(tmp_path, use_sacct=False)
    assert h.status == "error" and h.attempts[0].ended == "error" and h.final_step == 12
    assert "ValueError: bad batch at 12" in h.message


def in_place_story() -> list[dict]:
    """--spare-nodes: a crash restarted in place, then a hard node failure restarted in place."""
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    return [
        _rec("attempt_start", 1, 0, nodes=["n1", "n2"], ranks=2, restart_count=0, prev_end=none,
             resumed_step=None, steps_lost=None, in_place_restart=0),
        _losses(1, 10, 0, 60),
        _rec("checkpoint", 1, 8, step=50, kind="planned", blocking_s=0.02, persist_s=0.1),
        _rec("peer_lost", 1, 16, step=60, committed=True, lost_ranks=[1], failure_wall=T0 + 10.0,
             commit_wall=T0 + 15.5, save_s=0.2),
        _rec("relaunch", 1, 16.5, action="relaunch", restart=1, rc=137, lost={}, nodes=["n1", "n2"],
             reason="the ranks exited with status 137 (no node down); restart 1 of 3 in place on n1,n2",
             step_ended_wall=T0 + 16.0, decided_wall=T0 + 16.2),
        _rec("attempt_start", 2, 20, nodes=["n1", "n2"], ranks=2, restart_count=0,
             prev_end={"reason": "crash", "source": "relaunch", "detail": ""}, resumed_step=60, steps_lost=0,
             in_place_restart=1, process_wall=T0 + 16.7, session_wall=T0 + 19.5),
        _rec("resumed", 2, 19.6, step=60, restart_latency_s={"total": 9.6}),
        _losses(2, 30, 60, 100),
        _rec("relaunch", 2, 31, action="relaunch", restart=2, rc=1, lost={"n2": "down"}, nodes=["n1", "n3"],
             reason="node(s) n2 (down) lost; restart 2 of 3 in place on n1,n3",
             step_ended_wall=T0 + 30.5, decided_wall=T0 + 30.7),
        _rec("attempt_start", 3, 35, nodes=["n1", "n3"], ranks=2, restart_count=0,
             prev_end={"reason": "node_failure", "source": "relaunch", "detail": ""}, resumed_step=100,
             steps_lost=0, in_place_restart=2, process_wall=T0 + 31.0, session_wall=T0 + 34.0),
        _rec("resumed", 3, 34.2, step=100, restart_latency_s={"total": 3.7}),
        _losses(3, 40, 100, 150),
        _rec("end", 3, 40, step=150, status="completed", message=""),
    ]


def test_in_place_restarts_in_the_table_and_the_png(tmp_path: Path, capsys) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in in_place_story()))
    h = history.load(d, use_sacct=False)
    assert [a.ended for a in h.attempts] == ["crash (restarted in place)", "node_failure (restarted in place)",
                                             "completed"]
    ip = h.attempts[1].in_place
    # failure 10.0 -> step ended 16.0 -> decided 16.2 -> processes 16.7 -> Session 19.5 -> resumed 19.6
    assert ip is not None and ip["nodes"] == ["n1", "n2"]
    got = {k: round(ip[k], 2) for k in ("detect_s", "decide_s", "relaunch_s", "process_start_s", "restore_s",
                                        "total_s")}
    assert got == {"detect_s": 6.0, "decide_s": 0.2, "relaunch_s": 0.5, "process_start_s": 2.8, "restore_s": 0.1,
                   "total_s": 9.6}
    # No survivor record: the failure is known from the step's end only.
    assert round(h.attempts[2].in_place["detect_s"], 2) == 0.0 and round(h.attempts[2].in_place["total_s"], 2) == 3.7

    marks = history.interruptions(h)
    assert [(m.step, m.reason, m.in_place, m.resumed_step) for m in marks] == \
        [(60, "crash", True, 60), (100, "node_failure", True, 100)]
    assert [round(m.latency_s or 0, 1) for m in marks] == [9.6, 3.7]
    fig = history.figure(h)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "restarted in place: crash" in labels and "restarted in place: node_failure" in labels
    assert not any(lbl.startswith("interrupted:") for lbl in labels)
    texts = [t.get_text() for t in ax.texts]
    assert "crash\n0 lost\nin place 10s" in texts and "node_failure\n0 lost\nin place 4s" in texts
    assert "(2 restarted in place)" in ax.get_title()
    dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert sorted(ln.get_xdata()[0] for ln in dotted) == [60, 100]

    assert main([str(d), "--no-sacct", "--png", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "attempt 2: restarted in place on n1,n2 (in-place restart 1): 9.6s = detect 6.0 + decide 0.2 + " \
           "relaunch 0.5 + start 2.8 + restore 0.10" in out


def test_queue_restarts_stay_dashed(run_dir: Path) -> None:
    h = history.load(run_dir, use_sacct=False)
    assert not any(m.in_place for m in history.interruptions(h))
    ax = history.figure(h).axes[0]
    assert "interrupted: preemption" in ax.get_legend_handles_labels()[1]
    assert not [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]


# -- issue 26, items 4 and 13 -----------------------------------------------------------------------
def _done_then_more_then_refused() -> list[dict]:
    """Trained to 60 (completed), trained further to 100 (completed), then asked for 80: refused."""
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    after = {"reason": "none", "source": "none", "detail": "previous run ended completed"}
    return [
        _rec("attempt_start", 1, 0, nodes=["n1"], ranks=1, prev_end=none, resumed_step=None, steps_lost=None),
        _losses(1, 5, 0, 60),
        _rec("checkpoint", 1, 5, step=60, kind="final", blocking_s=0.01, persist_s=0.1),
        _rec("end", 1, 6, step=60, status="completed", message=""),
        _rec("attempt_start", 2, 10, nodes=["n1"], ranks=1, prev_end=after, resumed_step=60, steps_lost=None),
        _losses(2, 15, 60, 100),
        _rec("checkpoint", 2, 15, step=100, kind="final", blocking_s=0.01, persist_s=0.1),
        _rec("end", 2, 16, step=100, status="completed", message=""),
        _rec("attempt_start", 3, 20, nodes=["n1"], ranks=1, prev_end=after, resumed_step=100, steps_lost=None),
        _rec("end", 3, 21, step=100, status="refused", message="total_steps lower than the latest checkpoint's "
             "step (80 < 100); nothing was changed"),
    ]


def test_completed_attempts_show_completed_and_a_refusal_is_not_the_runs_end(tmp_path: Path, capsys) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _done_then_more_then_refused()))
    h = history.load(d, use_sacct=False)
    assert [a.ended for a in h.attempts] == ["completed", "completed", "refused"]
    assert h.status == "completed" and h.final_step == 100
    assert history.interruptions(h) == []          # nothing interrupted this run
    labels = history.figure(h).axes[0].get_legend_handles_labels()[1]
    assert not any(lbl.startswith("interrupted") for lbl in labels)
    assert main([str(d), "--no-sacct"]) == 0
    out = capsys.readouterr().out
    assert "status completed at step 100" in out and "none [none]" not in out
    assert "completed [session]" in out and "refused [session]" in out


def test_an_old_log_whose_refusal_says_error_is_still_completed(tmp_path: Path) -> None:
    recs = _done_then_more_then_refused()
    recs[-1] = _rec("end", 3, 21, step=100, status="error", message="UsageError: total_steps=80 is lower than "
                    "the step of the latest checkpoint in ck (100): this run already went further, there is "
                    "nothing to train and nothing was changed")
    h = history.build(recs, "ck")
    assert h.status == "completed" and h.attempts[-1].ended == "refused"


def test_a_run_trained_further_is_running_again(tmp_path: Path) -> None:
    h = history.build(_done_then_more_then_refused()[:6], "ck")
    assert h.status == "running" and h.final_step is None and h.attempts[0].ended == "completed"


def test_a_crash_whose_reason_says_lost_is_not_a_node_failure() -> None:
    recs = in_place_story()
    # coci-submit's relaunch loop wrote this for a crash that swapped a suspect node out
    recs[4] = {**recs[4], "reason": "the ranks exited with status 137 (no node down); restart 1 of 3 in place "
               "on n1,n3 (not n2: lost a task)"}
    h = history.build(recs, "ck")
    assert h.attempts[0].ended == "crash (restarted in place)"
    assert h.attempts[1].ended == "node_failure (restarted in place)"     # lost={"n2": "down"}: a node failure


def test_an_unreadable_line_is_counted_and_makes_no_attempt_0(run_dir: Path, capsys) -> None:
    text = (run_dir / "events.jsonl").read_text()
    lines = text.splitlines()
    # a damaged record that still parses (no attempt), and garbage
    lines[3:3] = ['{"v": 1, "event": "losses", "wall": 1795000030.0, "steps": [1], "values": [2.0]}', "\x00\x00garbage"]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    h = history.load(run_dir, use_sacct=False)
    assert [a.attempt for a in h.attempts] == [1, 2, 3, 4] and 0 not in h.loss_attempts
    assert h.skipped_lines == 3                    # the two above and the torn last line
    assert main([str(run_dir), "--no-sacct"]) == 0
    out = capsys.readouterr().out
    assert "event log: 3 unreadable line(s) skipped" in out
    assert not any(ln.split()[:1] == ["0"] for ln in out.splitlines())


def test_a_rank_and_partner_loss_names_the_lost_ranks(tmp_path: Path) -> None:
    """The memory tier's fallback (no copy of the lost ranks survived): the line names the ranks
    from the record's ``lost`` (nothing came from a partner, so ``lost_ranks`` is empty)."""
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    recs = [_rec("attempt_start", 1, 0, nodes=["n1", "n2", "n3"], ranks=3, restart_count=0, prev_end=none,
                 resumed_step=None, steps_lost=None),
            _rec("checkpoint", 1, 8, step=100, kind="planned", blocking_s=0.02, persist_s=0.1),
            _rec("peer_lost", 1, 16, step=120, committed=False, tier="disk", lost_ranks=[], lost=[1, 2],
                 reason="no memory-tier copy of rank(s) [1] survived", failure_wall=T0 + 10.0, fallback_step=100)]
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = history.render_text(history.load(d, use_sacct=False))
    assert "attempt 1: rank(s) [1, 2] were lost after step 120; no survivors' checkpoint" in text, text
    assert "fell back to step 100 (the disk tier served)" in text


# -- issue 34: the progress records ----------------------------------------------------------------
def test_a_crash_shows_the_step_the_progress_records_read_and_a_lower_bound_says_so() -> None:
    """Attempt 1 crashed after step 63 with its losses flushed to 52; attempt 2 read 63 from the
    progress records (exact); attempt 3 found no record of attempt 2 (a lower bound, ">=")."""
    none = {"reason": "none", "source": "none", "detail": "first attempt"}
    crash = {"reason": "crash", "source": "session", "detail": "no stop or end record"}
    recs = [
        _rec("attempt_start", 1, 0, None, nodes=[], ranks=1, prev_end=none, resumed_step=None, steps_lost=None),
        _losses(1, 5, 0, 52),
        _rec("checkpoint", 1, 4, None, step=50, kind="planned", blocking_s=0.01, persist_s=0.1),
        _rec("attempt_start", 2, 10, None, nodes=[], ranks=1, prev_end=crash, resumed_step=50, steps_lost=13,
             steps_lost_exact=True, prev_last_step=63),
        _losses(2, 15, 50, 80),
        _rec("attempt_start", 3, 20, None, nodes=[], ranks=1, prev_end=crash, resumed_step=75, steps_lost=5,
             steps_lost_exact=False, prev_last_step=80),
    ]
    h = history.build(recs, "/ckpt")
    assert [a.last_step for a in h.attempts] == [63, 80, 75] and h.steps_lost_total == 18
    rows = history.render_text(h).splitlines()
    row = {int(r.split()[0]): r.split() for r in rows if r.strip()[:1].isdigit()}   # att job start from lost ...
    assert (row[2][3:5], row[3][3:5]) == (["50", "13"], ["75", ">=5"]), rows
    assert row[1][-4:] == ["63", "crash", "[session]", "-"], rows                    # to, ended, sacct
