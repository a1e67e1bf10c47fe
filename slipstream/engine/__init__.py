"""The engine: forward/backward/step, accumulation, schedulers, optimizers, logs."""
