"""Slurm adapters: the only code that talks to Slurm or parses its output."""
