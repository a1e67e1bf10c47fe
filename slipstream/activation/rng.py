"""Named RNG states for model-parallel regions (DeepSpeed's `CudaRNGStatesTracker`), on any accelerator.

Dropout inside a tensor-parallel region must differ between the ranks of a tensor-parallel group (each holds
different columns) but be equal across data-parallel replicas; outside it, the reverse. The tracker keeps
extra RNG states by name, and `fork(name)` runs a block with one of them, then restores the default state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from slipstream.accelerator import get_accelerator
from slipstream.activation.mpu import model_parallel_rank

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718  # DeepSpeed's (and Megatron's) offset between the data- and model-parallel seeds


class RNGStatesTracker:
    """Device RNG states by name; `fork(name)` swaps one in for a block."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state; give {name!r} its own")
        if name in self.states:
            raise ValueError(f"RNG tracker: a state named {name!r} exists already; reset() first to re-seed it")
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(saved)
        self.seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            raise KeyError(
                f"RNG tracker: no state named {name!r}; call model_parallel_cuda_manual_seed(seed) or add() first"
            )
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's name; it tracks the current accelerator's RNG, CUDA or not)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, mpu: object = None) -> None:
    """Seed the default RNG with `seed` (equal across a tensor-parallel group) and the model-parallel state with
    `seed + 2718 + tensor-parallel rank` (different within the group), as DeepSpeed and Megatron do."""
    group_rank = model_parallel_rank(mpu)  # the configured mpu's, when none is given
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + group_rank)
