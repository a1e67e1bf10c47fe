"""The planner-guided tuner behind `slipstream run --autotuning tune|run` (DeepSpeed's `deepspeed --autotuning`).

Modules: `space` (the candidates and their configs), `estimates` (the planner's figures, computed in the profile
run where the model lives), `select` (pruning against the memory budget, ranking), `tuner` (profile, prune,
trials as launched jobs), `trial` (the engine's side: the profiled steps' metrics file), `results` (DeepSpeed's
results layout), `command` (the CLI's entry). See docs/autotuning.md. Importing this package imports nothing.
"""

from __future__ import annotations
