"""Integrations with training frameworks that own the loop (PyTorch Lightning, the Hugging Face
Trainer). Each lives in its own module and imports its framework; this package imports nothing,
so ``import coci_hpc`` never pulls in an optional dependency."""
