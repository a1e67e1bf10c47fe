"""Training monitors (csv, tensorboard, wandb, comet): writers.py."""
