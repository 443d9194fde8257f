"""coci_hpc: fault tolerance for deep-learning training on Slurm."""

__version__ = "0.1.0"
