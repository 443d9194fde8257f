"""Integrations with training frameworks that own the loop (PyTorch Lightning, the Hugging Face
Trainer). Each lives in its own module and imports its framework; importing this package imports
neither."""
