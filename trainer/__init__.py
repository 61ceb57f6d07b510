"""The trainer: config, distributed setup, the training loop, checkpoints and logging.
Only this package and train.py see every other package (docs/architecture.md, "Dependency rules")."""
