"""coci-submit: submit a training script to Slurm through submitit (spec, checks, executor, runner)."""
