"""The launcher behind `slipstream run`: hostfile and filters (hostfile.py), the exported environment
(environment.py), the launch plan (plan.py), multi-node command lines (multinode.py), the runner
(runner.py), the per-node entry (node.py), the per-node launch on PyTorch's elastic agent (local.py) and
the per-rank exec shim (rank_exec.py). Importing it imports no torch."""
