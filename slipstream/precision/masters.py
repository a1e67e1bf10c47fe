"""Low-precision master weights and optimizer states: the optimizer's side.

With `bf16.bf16_master_weights_and_grads` (or `fp16.fp16_master_weights_and_grads`) the ZeRO groups take the
low-precision parameters' shards as their masters (zero/flat_group.py, zero/stage3/group.py: the master dtype
is the parameter dtype, so the master pieces are views of the parameters, or their host copies with offload)
and the optimizer steps them directly. Its moments then follow the plan's `optimizer_state_dtype`:
- bf16 (`bf16_optimizer_states`): torch's and FusedAdam's states take the parameter dtype by themselves; the
  CPU Adam op is told to keep them in bf16 (`fp32_optimizer_states=False`, as DeepSpeed overrides it);
- fp32: only an optimizer that keeps fp32 moments of low-precision parameters can do it (the CPU Adam op,
  which is why DeepSpeed asks for CPU offload here); any other is refused before the first step.
The update is rounded to nearest when it is stored in the low-precision masters (torch's own rounding), or,
with `bf16.stochastic_rounding` (Slipstream's own), stochastically (`StochasticRounding`).
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.config.plan import PrecisionPlan
from slipstream.utils.logging import warn_once


def apply_state_dtype(optimizer: torch.optim.Optimizer, precision: PrecisionPlan) -> None:
    """Make `optimizer` keep its moments in the plan's state dtype, or refuse it naming the keys (and one that
    cannot round stochastically, when asked to)."""
    if precision.master_rounding == "stochastic":
        check_elementwise(optimizer)
    if precision.master_dtype == "fp32":
        return
    keeps_fp32 = getattr(optimizer, "fp32_optimizer_states", None)
    if precision.optimizer_state_dtype != "fp32":
        if keeps_fp32:
            warn_once(
                "bf16-optimizer-states-cpu-adam",
                "slipstream: bf16.bf16_optimizer_states is on; the CPU Adam's fp32_optimizer_states is set to "
                "False so its moments are kept in bf16",
            )
            optimizer.fp32_optimizer_states = False  # type: ignore[attr-defined]
        return
    if keeps_fp32 is not True:
        key = f"{precision.master_dtype}.{precision.master_dtype}_master_weights_and_grads"
        raise ValueError(
            f"{key}: the optimizer must keep fp32 moments of the {precision.master_dtype} masters, which only "
            f"the CPU Adam op does (DeepSpeedCPUAdam with fp32_optimizer_states=True, built for an 'Adam' or "
            f"'AdamW' optimizer section with CPU offload); got {type(optimizer).__name__}. Use that "
            f"optimizer{', or set bf16.bf16_optimizer_states true' if precision.master_dtype == 'bf16' else ''}"
        )


CHUNK_NUMEL = 2**21
"""Elements of a master piece stepped at once under stochastic rounding: five fp32 scratch rows of this size
(the piece, its gradient and up to three moments; 40 MiB) and the rounding's noise and mask rows
(`RoundingScratch`, 10 MiB) are allocated once and reused."""


class NearestRounding:
    """The optimizer steps the low-precision masters itself; each new value is rounded to nearest when stored
    (torch's rounding, DeepSpeed's). The default."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


_EXPONENT = 0x7F800000
"""The fp32 exponent bits: all set in inf and nan, which pass through the rounding unchanged."""


@dataclasses.dataclass(frozen=True, slots=True)
class RoundingScratch:
    """The work rows of `stochastic_round_`, allocated once by their owner and reused by every call (fresh ones
    per chunk cost page faults on every step): `noise` holds the random integers (int32) and `finite` the mask of
    the finite values."""

    noise: torch.Tensor
    finite: torch.Tensor

    @staticmethod
    def allocate(numel: int, device: torch.device) -> RoundingScratch:
        return RoundingScratch(
            noise=torch.empty(numel, dtype=torch.int32, device=device),
            finite=torch.empty(numel, dtype=torch.bool, device=device),
        )


def stochastic_round_(
    out: torch.Tensor, values: torch.Tensor, generator: torch.Generator, scratch: RoundingScratch | None = None
) -> None:
    """`out` (bf16) := `values` (fp32) rounded up or down to a neighbouring bf16 value with probabilities that
    make the expected result `values` itself: a uniform random 16-bit integer is added to the fp32 bit pattern
    and the 16 bits bf16 drops are cleared (sign and magnitude, so negative values round alike). `scratch` (at
    least `values.numel()` elements; allocated here when not given) holds the noise, and then the result in fp32,
    so that the call allocates nothing."""
    numel = values.numel()
    if scratch is None:
        scratch = RoundingScratch.allocate(numel, values.device)
    bits = values.view(torch.int32)
    noise, finite = scratch.noise[:numel].view(values.shape), scratch.finite[:numel].view(values.shape)
    torch.ne(torch.bitwise_and(bits, _EXPONENT, out=noise), _EXPONENT, out=finite)
    torch.randint(0, 1 << 16, values.shape, generator=generator, out=noise)
    rounded = noise.add_(bits).bitwise_and_(-(1 << 16)).view(torch.float32)
    out.copy_(torch.where(finite, rounded, values, out=rounded))  # inf and nan pass through unchanged


class StochasticRounding(NearestRounding):
    """`bf16.stochastic_rounding` (Slipstream's own): each bf16 master piece is stepped on fp32 copies, in
    chunks of `chunk_numel` elements through reused scratch rows, and the new values are rounded
    stochastically when stored, so an update smaller than half a bf16 step moves the masters in expectation
    instead of being lost; the moments are stored rounded to nearest, as without the option. Every rank draws
    from one generator seeded alike (each rank rounds its own shard)."""

    def __init__(self, *, seed: int = 0, chunk_numel: int = CHUNK_NUMEL) -> None:
        self.seed = seed
        self.chunk_numel = chunk_numel
        self._scratch: torch.Tensor | None = None
        self._noise: RoundingScratch | None = None
        self._generator: torch.Generator | None = None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        try:
            for group in groups:
                for piece in group["params"]:
                    if piece.grad is not None:
                        self._step_piece(optimizer, group, piece)
        finally:
            optimizer.param_groups = groups

    def _step_piece(self, optimizer: torch.optim.Optimizer, group: dict, piece: torch.Tensor) -> None:
        data, grad = piece.data, piece.grad
        assert grad is not None  # only pieces with a gradient are stepped
        if not optimizer.state[piece]:  # create the moments (zeros, in the piece's dtype) without an update
            piece.grad = torch.zeros_like(grad)
            self._run(optimizer, {**group, "lr": 0.0, "weight_decay": 0.0}, piece)
            optimizer.state[piece]["step"].zero_()  # torch's Adam counts steps in a tensor
            piece.grad = grad
        state = optimizer.state[piece]
        moments = {k: t for k, t in state.items() if isinstance(t, torch.Tensor) and t.dim() > 0}  # not "step"
        step: torch.Tensor = state["step"]
        before = step.clone()
        scratch = self._rows(piece.device)
        try:
            for start in range(0, data.numel(), self.chunk_numel):
                end = min(start + self.chunk_numel, data.numel())
                rows = [row[: end - start] for row in scratch]
                rows[0].copy_(data[start:end])
                rows[1].copy_(grad[start:end])
                for row, moment in zip(rows[2:], moments.values()):
                    row.copy_(moment.view(-1)[start:end])
                piece.grad = None
                piece.data = rows[0]
                piece.grad = rows[1]
                state.update(zip(moments, rows[2:]))
                step.copy_(before)  # every chunk is the same step
                self._run(optimizer, group, piece)
                stochastic_round_(data[start:end], rows[0], self._generator, self._noise)  # type: ignore[arg-type]
                for row, moment in zip(rows[2:], moments.values()):
                    moment.view(-1)[start:end].copy_(row)
        finally:
            piece.grad = None
            piece.data = data
            piece.grad = grad
            state.update(moments)

    @staticmethod
    def _run(optimizer: torch.optim.Optimizer, group: dict, piece: torch.Tensor) -> None:
        """One optimizer step of `piece` alone under `group`'s hyperparameters."""
        optimizer.param_groups = [{**group, "params": [piece]}]
        optimizer.step()

    def _rows(self, device: torch.device) -> list[torch.Tensor]:
        if self._scratch is None or self._scratch.device != device:
            self._scratch = torch.empty(5, self.chunk_numel, dtype=torch.float32, device=device)
            self._noise = RoundingScratch.allocate(self.chunk_numel, device)
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return list(self._scratch)


ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Stochastic rounding steps a piece in chunks, with moments created as zeros: Adam's update is elementwise
    and its moments start at zero, so it may run so."""
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"bf16.stochastic_rounding: {type(optimizer).__name__} is not Adam, AdamW or FusedAdam, whose "
            f"elementwise step can be taken chunk by chunk; use an 'Adam' or 'AdamW' optimizer or set "
            f"bf16.stochastic_rounding false"
        )


def master_rounding(precision: PrecisionPlan) -> NearestRounding:
    """How the optimizer's new master values are stored: `StochasticRounding` or `NearestRounding`."""
    return StochasticRounding() if precision.master_rounding == "stochastic" else NearestRounding()
