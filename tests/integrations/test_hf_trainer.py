"""coci_hpc.integrations.transformers in one process: a Hugging Face Trainer stopped by a signal
mid-epoch resumes bit-identically and trains on every sample once; bad input is refused with the
fix; the Trainer's private methods it overrides still have the signatures it was written for."""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from coci_hpc.errors import UsageError  # noqa: E402
from coci_hpc.integrations import transformers as hf  # noqa: E402
from coci_hpc.runtime.events import read_events  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

NO_SLURM: dict[str, str] = {}
STEPS, GA, EVERY = 40, 2, 10      # 64 batches = 32 steps per epoch: the run crosses an epoch's end


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_train", ROOT / "examples" / "hf_trainer_train.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = _example()


class Recording(hf.CociTrainer):
    """Records (step, sample indices) of every batch it trains on."""

    def __init__(self, *args: Any, seen: list[tuple[int, list[int]]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen = seen

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append((self.state.global_step + 1, inputs.pop("idx").tolist()))
        return super().training_step(model, inputs, num_items_in_batch)


class SignalAt(TrainerCallback):
    """Sends this process SIGUSR2 inside step ``at`` (as Slurm's warning would arrive)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGUSR2)


def _trainer(ckpt: Path, seen: list, *, callbacks: list | None = None, cls: type = Recording, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=EX.VOCAB, n_positions=EX.SEQ, n_embd=32,
                                                                 n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(ckpt / "hf-out"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=GA, learning_rate=3e-3, warmup_steps=5, weight_decay=0.01, logging_steps=7,
        # an evaluation draws from the global RNG between steps: the stop's RNG must be taken after it
        eval_strategy="steps", eval_steps=7, per_device_eval_batch_size=8, eval_on_start=True,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
        remove_unused_columns=False, **extra)
    kwargs: dict[str, Any] = {}
    if cls is not Trainer:
        kwargs = {"seen": seen, "coci": {"ckpt_dir": ckpt, "policy": f"fixed:{EVERY}", "environ": NO_SLURM}}
    return cls(model=model, args=args, train_dataset=EX.TokenSequences(EX.SAMPLES), eval_dataset=EvalSet(),
               callbacks=callbacks, **kwargs)


class EvalSet(torch.utils.data.Dataset):
    """16 sequences of another draw, without the index the model does not take."""

    def __init__(self) -> None:
        self.rows = EX.TokenSequences(16, seed=7)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.rows[i].items() if k != "idx"}


def _params(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list[torch.Tensor]]:
    seen: list = []
    t = _trainer(tmp_path_factory.mktemp("ref"), seen)
    t.train()
    return seen, _params(t)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
def test_a_signal_mid_epoch_stops_at_a_boundary_and_the_resumed_run_is_bit_identical(
        tmp_path: Path, reference: tuple[list, list[torch.Tensor]], workers: int) -> None:
    ref_seen, ref_params = reference
    first: list = []
    before = signal.getsignal(signal.SIGUSR2)
    # With workers the loader runs ahead of the loop: the position saved is what the loop consumed.
    with pytest.raises(SystemExit) as stop:
        _trainer(tmp_path, first, callbacks=[SignalAt(20)], dataloader_num_workers=workers).train()
    assert stop.value.code == 0
    assert signal.getsignal(signal.SIGUSR2) == before           # the Session gave the signal back
    second: list = []
    resumed = _trainer(tmp_path, second, dataloader_num_workers=workers)
    resumed.train()

    stopped = first[-1][0]
    assert stopped == 21                                          # one boundary after the signal (pipelined)
    assert second[0][0] == stopped + 1                            # nothing repeated, nothing skipped
    assert first + second == ref_seen                             # the same batches in the same order
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), ref_params))
    # every sample once per epoch: 64 batches of 4 are epoch 0, the rest is epoch 1
    flat = [i for _, idx in first + second for i in idx]
    assert sorted(flat[:256]) == list(range(256)) and len(set(flat[256:])) == len(flat[256:])
    assert resumed.state.global_step == STEPS and resumed.state.epoch == pytest.approx(STEPS * GA / 64)
    ev = read_events(tmp_path)
    stops = [e for e in ev if e["event"] == "stop"]
    assert [(s["step"], s["signal"]) for s in stops] == [(stopped, "SIGUSR2")]
    assert [e for e in ev if e["event"] == "attempt_start"][1]["resumed_step"] == stopped
    assert ev[-1]["event"] == "end" and ev[-1]["status"] == "completed"


def test_a_finished_run_trains_nothing_more_and_a_resume_point_outside_the_store_is_refused(
        tmp_path: Path, reference: tuple[list, list[torch.Tensor]]) -> None:
    _trainer(tmp_path, []).train()
    again: list = []
    t = _trainer(tmp_path, again)
    t.train(resume_from_checkpoint=str(tmp_path))                 # the store itself: accepted
    assert again == [] and all(torch.equal(a, b) for a, b in zip(_params(t), reference[1]))

    hf_ckpt = tmp_path / "hf-out" / "checkpoint-20"
    with pytest.raises(UsageError) as e:
        _trainer(tmp_path, []).train(resume_from_checkpoint=str(hf_ckpt))
    assert "disagrees with coci's store" in e.value.message and f"step: {STEPS}" in e.value.message
    assert "without resume_from_checkpoint" in (e.value.hint or "")


class StopAt(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def test_a_trainer_stopped_early_by_a_callback_keeps_its_last_checkpoint(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    seen: list = []
    t = _trainer(tmp_path, seen, callbacks=[StopAt(15)])
    t.train()                                                     # returns: not a coci stop
    assert seen[-1][0] == 15 and t.state.global_step == 15
    assert "stopped at step 15 before max_steps: no final checkpoint" in capfd.readouterr().err
    kinds = [(e["step"], e["kind"]) for e in read_events(tmp_path) if e["event"] == "checkpoint"]
    assert kinds == [(10, "planned")]
    again: list = []
    _trainer(tmp_path, again, callbacks=[StopAt(25)]).train()
    assert again[0][0] == 11                                      # resumed from the last committed step


def test_the_callback_on_a_plain_trainer_is_refused_naming_the_trainer_to_use(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(UsageError) as e:
        _trainer(tmp_path, [], cls=Trainer, callbacks=[hf.CociCallback()]).train()
    assert "not a CociTrainer" in e.value.message and "CociTrainerMixin" in (e.value.hint or "")
    assert signal.getsignal(signal.SIGUSR2) == before and not (tmp_path / "events.jsonl").exists()
    removed = _trainer(tmp_path, [])
    removed.remove_callback(hf.CociCallback)
    with pytest.raises(UsageError, match="callback was removed"):
        removed.train()
    assert removed.state.global_step == 0                        # refused before any step


def _plain(ckpt: Path, **kwargs: Any) -> Any:
    return _trainer(ckpt, [], cls=Trainer, **kwargs)


@pytest.mark.parametrize("bad, words", [
    ({"coci": {"ckpt_dirr": "x"}}, "unknown coci= settings: ckpt_dirr"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_bad_settings_are_refused_at_construction(tmp_path: Path, bad: dict, words: str) -> None:
    with pytest.raises(UsageError, match=re.escape(words)):
        if "coci" in bad:
            Recording(model=torch.nn.Linear(1, 1), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                           report_to="none"),
                      seen=[], coci=bad["coci"])
        else:
            _trainer(tmp_path, [], **bad)


def test_an_iterable_dataset_is_refused(tmp_path: Path) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.zeros(4, dtype=torch.long)}

    t = _trainer(tmp_path, [])
    t.train_dataset = Stream()
    with pytest.raises(UsageError, match="map-style dataset"):
        t.get_train_dataloader()


# -- the private API ------------------------------------------------------------------------------
def test_the_private_methods_have_the_signatures_the_integration_was_written_for() -> None:
    hf.check_private_api()                          # the installed transformers
    for name, params in hf.PRIVATE_API.items():
        assert tuple(inspect.signature(getattr(Trainer, name)).parameters) == params, name
    loop = inspect.getsource(Trainer._inner_training_loop)
    # The Session starts at on_train_begin (after the optimizer and scheduler exist), before any epoch.
    assert loop.index("_prepare_for_training(") < loop.index("on_train_begin") < loop.index("self._run_epoch(")
    assert "self._globalstep_last_logged = self.state.global_step" in loop
    epoch = inspect.getsource(Trainer._run_epoch)
    # The boundary is the fetch of the next step's batches; steps_in_epoch and the update count
    # are what _run_epoch's loop runs on, and after a resume they describe the rest of the epoch.
    assert epoch.index("self.get_batch_samples(") < epoch.index("self.training_step(")
    for used in ("steps_in_epoch % self.args.gradient_accumulation_steps",
                 "range(num_update_steps_trained, num_update_steps_per_epoch)", "(step + 1) == steps_in_epoch"):
        assert used in epoch, used


def test_a_drifted_private_method_is_refused_naming_the_tested_versions() -> None:
    class Drifted(Trainer):
        def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch):  # type: ignore[override]
            pass

    with pytest.raises(UsageError) as e:
        hf.check_private_api(Drifted)
    assert "_run_epoch(self, model, epoch, train_dataloader, steps_in_epoch)" in e.value.message
    assert hf.TESTED in (e.value.hint or "")


def test_the_extra_pins_the_tested_range_and_the_core_does_not_import_transformers() -> None:
    from packaging.requirements import Requirement

    line = re.search(r"^hf = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml declares the hf extra"
    extra = re.findall(r'"([^"]+)"', line.group(1))
    pins = {Requirement(r).name: Requirement(r).specifier for r in extra}
    assert str(pins["transformers"]) == str(Requirement(f"transformers{hf.TESTED}").specifier)
    assert transformers.__version__ in pins["transformers"]
    import accelerate
    assert accelerate.__version__ in pins["accelerate"]
    code = ("import sys, coci_hpc, coci_hpc.session, coci_hpc.integrations, coci_hpc.cli.ckpt; "
            "sys.exit(int(any(m.split('.')[0] in ('transformers', 'accelerate') for m in sys.modules)))")
    import subprocess
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0
