"""The Hugging Face Trainer with coci_hpc: a tiny GPT-2 built from a config (nothing downloaded), a
synthetic token data set, and CociTrainer instead of Trainer.

    python examples/hf_trainer_train.py --steps 60 --ckpt-dir /tmp/hf-run
    mpiexec -n 2 python -m mpi4py examples/hf_trainer_train.py --steps 60 --ckpt-dir /tmp/hf-run --policy fixed:20
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py ...   (or srun / the sbatch templates / coci-submit)

Killed or preempted and started again with the same arguments, it resumes mid-epoch from its
checkpoint directory and ends with the same parameters as an uninterrupted run. Each rank prints
``batch step=<n> rank=<r> idx=<i,j,...>`` for every batch it trains on (the sample indices, so a
test can check that no sample is seen twice or skipped; with ``--samples-log DIR`` appended to
``DIR/rank<r>.txt`` instead, where other ranks' output cannot interleave), rank 0 ``step=<n>`` after each step and
``final_params_sha256=<hex>`` at the end. Without --ckpt-dir / --policy the values come from
coci-submit's environment (COCI_CKPT_DIR, COCI_POLICY).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")      # nothing is downloaded
os.environ.setdefault("OMP_NUM_THREADS", "1")     # Accelerate picks a thread count otherwise: same numbers everywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transformers  # noqa: E402
from toy_task import params_sha256  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from coci_hpc.integrations.transformers import CociTrainer, init_distributed  # noqa: E402

VOCAB, SEQ, SAMPLES = 32, 16, 256


class TokenSequences(torch.utils.data.Dataset):
    """Sequences that count up by a per-sample stride modulo VOCAB (learnable), and their index."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        rng = np.random.default_rng(seed)
        start = rng.integers(0, VOCAB, n)
        stride = rng.integers(1, 4, n)
        self.tokens = torch.from_numpy((start[:, None] + stride[:, None] * np.arange(SEQ)) % VOCAB).long()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i], "idx": torch.tensor(i)}


class ExampleTrainer(CociTrainer):
    """Reports which samples each rank trains on (and adds pretend work per batch)."""

    step_time = 0.0
    samples_log: Path | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        idx = inputs.pop("idx")
        rank = self.args.process_index
        line = f"batch step={self.state.global_step + 1} rank={rank} idx={','.join(str(int(i)) for i in idx)}\n"
        if self.samples_log is None:
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            with open(self.samples_log / f"rank{rank}.txt", "a") as f:
                f.write(line)
        if self.step_time:
            time.sleep(self.step_time)
        return super().training_step(model, inputs, num_items_in_batch)


class PrintSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step={state.global_step}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps of the whole run (max_steps)")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: $COCI_CKPT_DIR)")
    ap.add_argument("--policy", default=None, help="checkpoint policy: coci, young, fixed:N, ... (default: $COCI_POLICY)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of pretend extra work per batch")
    ap.add_argument("--samples-log", type=Path, default=None, help="append each rank's batch lines to DIR/rank<r>.txt")
    args = ap.parse_args(argv)

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist = init_distributed()        # torch.distributed from MPI, Slurm or torchrun, and Accelerate told of it
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)   # dropout 0.1
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=str(Path(tempfile.gettempdir()) / "hf_trainer_train-out"), max_steps=args.steps,  # nothing is written
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=5, weight_decay=0.01,
        logging_steps=25, save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed,
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, dataloader_num_workers=0)
    coci = {k: v for k, v in {"ckpt_dir": args.ckpt_dir, "policy": args.policy}.items() if v is not None}
    ExampleTrainer.step_time, ExampleTrainer.samples_log = args.step_time, args.samples_log
    if args.samples_log is not None:
        args.samples_log.mkdir(parents=True, exist_ok=True)
    trainer = ExampleTrainer(model=model, args=targs, train_dataset=TokenSequences(SAMPLES),
                             callbacks=[PrintSteps()], coci=coci)
    trainer.train()
    digest = params_sha256(trainer.model)
    if dist.rank == 0:
        print(f"final_params_sha256={digest}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
