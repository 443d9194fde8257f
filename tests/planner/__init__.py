"""Tests of the COCI planner, its Slurm accounting adapters and coci-plan."""
