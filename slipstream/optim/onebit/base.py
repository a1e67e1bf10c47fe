"""What the 1-bit optimizers share: DeepSpeed's communication arguments, the process group the ZeRO-0 optimizer
names, one `OneBitAllReduce` (and so one pair of error buffers) per parameter, the momentum mask and the Adam
update.

[Note: exp_avg_mask]
A param group may hold an `exp_avg_mask`, as in DeepSpeed: a tensor with one entry per element of the group's
parameters (flattened and concatenated in the group's order; a one-parameter group may give it in the
parameter's shape). 1-bit compression cannot send an exact zero, so momentum that should stay zero (embedding rows
a shorter sequence never uses) would collect compression error; every compressed mean of a parameter's values
(1-bit Adam's and LAMB's momentum, 0/1 Adam's gradient and accumulated update) is multiplied by the mask, as
DeepSpeed multiplies its compressed buffers. ZeRO hands the optimizer pieces, so the group's mask is cut into one
per piece through the whole-tensor map (built once per mask tensor; padding keeps 1). Checkpoints keep each
group's mask among the rank's tensors ('group<g>.exp_avg_mask'), and loading keeps the live group's mask, or its
absence, as DeepSpeed's load_state_dict does: the mask belongs to the training script's stage (BERT's 128- and
512-token phases use different ones).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from slipstream.comm.compressed import OneBitAllReduce, Scratch, padded_numel
from slipstream.optim.arguments import AdamFamily
from slipstream.optim.common import WholeTensorOptimizer
from slipstream.utils.logging import get_logger, warn_once

__all__ = ["MASK_KEY", "FreezeStepArguments", "OneBitArguments", "OneBitBase", "Params", "adam_update"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]
COMM_BACKENDS = ("nccl", "gloo", "mpi")
MASK_KEY = "exp_avg_mask"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBitArguments(AdamFamily):
    """The arguments every 1-bit optimizer takes: the Adam family's and DeepSpeed's communication ones."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = (
        "lr", "bias_correction", "betas", "eps", "weight_decay", "max_grad_norm"
    )  # fmt: skip
    cuda_aware: bool = False
    """Accepted as DeepSpeed's; the collectives run on whatever the process group's backend reaches."""
    comm_backend_name: str = "nccl"

    def problems(self) -> list[str]:
        out = super().problems()
        if self.comm_backend_name not in COMM_BACKENDS:
            out.append(
                f"comm_backend_name={self.comm_backend_name!r} is not supported; use one of "
                f"{', '.join(COMM_BACKENDS)} (every one runs over torch.distributed's process group here)"
            )
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class FreezeStepArguments(OneBitArguments):
    """1-bit Adam's and 1-bit LAMB's arguments: the communication ones and the length of the warm-up."""

    freeze_step: int = 100000
    """Warm-up steps: full-precision steps (Adam's or LAMB's) with all-reduced gradients, before the variance
    freezes."""

    def problems(self) -> list[str]:
        out = super().problems()
        if self.freeze_step < 0:
            out.append(f"freeze_step={self.freeze_step} must be >= 0 (the number of warm-up steps)")
        return out


def adam_update(p: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, group: dict[str, Any], out: Tensor) -> Tensor:
    """DeepSpeed's 1-bit Adam update (no bias correction): m / (sqrt(v) + eps), plus weight_decay * p, in `out`
    (shaped like `p`; the optimizer's `work_buffer(p)`)."""
    update = torch.div(exp_avg, torch.sqrt(exp_avg_sq, out=out).add_(group["eps"]), out=out)
    if group["weight_decay"] > 0.0:
        update.add_(p, alpha=group["weight_decay"])
    return update


class OneBitBase(WholeTensorOptimizer):
    """The arguments, the compressed all-reduce and the momentum mask common to OneBitAdam, ZeroOneAdam and
    OneBitLamb."""

    runs_on_host = False  # the whole-tensor map serves the mask and LAMB's norms; offload is not built for them
    tensor_group_keys: ClassVar[tuple[str, ...]] = (MASK_KEY,)
    """Param-group entries that are tensors: engine checkpoints keep them among this rank's tensors (`rank_tensors`),
    not with the JSON hyperparameters."""
    zero_stages: ClassVar[tuple[int, ...]] = (0,)
    """The ZeRO stages it runs at; zero/build.py refuses the others, giving `zero_refusal` as the reason."""
    zero_refusal: ClassVar[str] = "it compresses state that a sharded stage holds only a shard of"
    cuda_aware: bool
    comm_backend_name: str
    freeze_step: int
    """1-bit Adam's and LAMB's warm-up steps (FreezeStepArguments sets the attribute; see `own()`)."""

    def __init__(self, params: Params, arguments: OneBitArguments, **group_defaults: object) -> None:
        """`arguments` checked themselves (arguments.py); `group_defaults` join the param-group defaults."""
        super().__init__(params, {**arguments.group_defaults(), **group_defaults})
        self.label: str = arguments.label()
        for name, value in arguments.own().items():  # freeze_step, comm_backend_name, ...: attributes, as DeepSpeed's
            setattr(self, name, value)
        self.process_group: dist.ProcessGroup | None = None
        self._all_reduces: dict[str, OneBitAllReduce] = {}
        """By name: '<group>.<index>' for a parameter, the ZeRO optimizer's name for a gradient bucket."""
        self._loaded_errors: dict[str, tuple[Tensor, Tensor]] = {}
        """Errors from load_state_dict, copied into each all-reduce when it is built."""
        self._gradient_buckets: dict[str, int] = {}
        """ZeRO stage 1: the gradient buckets it compresses, name -> numel (`attach_gradient_buckets`)."""
        self._work: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}
        self._scratches: dict[tuple[torch.dtype, torch.device], Scratch] = {}
        self._masks: dict[Tensor, tuple[Tensor, Tensor]] = {}
        """Per piece: (the group's mask tensor it was cut from, the piece's mask) ([Note: exp_avg_mask])."""
        for index, group in enumerate(self.param_groups):
            if group.get("non_freeze"):
                warn_once(
                    f"onebit-non-freeze:{self.label}",
                    f"{self.label}: param group {index} sets non_freeze, which Slipstream's 1-bit optimizers do not "
                    "build: its momentum is compressed after the warm-up like every other group's",
                )

    def work_buffer(self, p: Tensor, slot: int = 0) -> Tensor:
        """A scratch tensor shaped like `p`, a view of one buffer per dtype, device and `slot` (a step that needs
        two scratch tensors at once asks for slots 0 and 1) that fits the largest parameter (allocated at the
        first step, reused by every parameter's update)."""
        key = (p.dtype, p.device, slot)
        buffer = self._work.get(key)
        if buffer is None or buffer.numel() < p.numel():
            largest = max(q.numel() for group in self.param_groups for q in group["params"] if q.dtype == p.dtype)
            buffer = self._work[key] = torch.empty(largest, dtype=p.dtype, device=p.device)
        return buffer[: p.numel()].view_as(p)

    # ---- the ZeRO-0 optimizer's questions ----
    def takes_over_reduction(self, group: dist.ProcessGroup | None) -> bool:
        """True when the next step communicates itself: its gradients must arrive un-reduced (this rank's own)."""
        if group is not self.process_group:
            self.process_group = group
            self._all_reduces.clear()
            self._scratches.clear()
        return self.next_step_is_local()

    def attach_gradient_buckets(self, buckets: dict[str, int]) -> None:
        """ZeRO stage 1 ([Note: 1-bit gradients at stage 1] in zero/stage1.py): after the warm-up the ZeRO
        optimizer hands each of `buckets` (name -> numel), this rank's gradients, to `compressed_mean`, and this
        optimizer steps its shard with the mean. Only optimizers whose `zero_stages` hold 1 do this."""
        if 1 not in self.zero_stages:
            raise ValueError(f"{self.label} does not run at ZeRO stage 1: {self.zero_refusal}")
        self._gradient_buckets = dict(buckets)
        self._all_reduces.clear()

    def compresses_gradients(self) -> bool:
        """The ZeRO optimizer compresses the gradients (stage 1): the steps after the warm-up use them as given."""
        return bool(self._gradient_buckets)

    def next_step_is_local(self) -> bool:
        """After the warm-up of `freeze_step` steps (1-bit Adam and LAMB; 0/1 Adam has its own schedule)."""
        return self.steps_done() >= self.freeze_step

    @property
    def warmup_over(self) -> bool:
        """True once the `freeze_step` warm-up steps are done (also after a load): DeepSpeed's flag, which 1-bit
        Adam names `adam_freeze_key` and 1-bit LAMB `lamb_freeze_key`."""
        return self.next_step_is_local()

    def adam_state(self, p: Tensor) -> dict[str, Any]:
        """`p`'s state, started at its first step: the step count and both moments."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        return state

    def first_state(self) -> dict[str, Any] | None:
        """The state of the first parameter that has one (the step counters are the same in every parameter's)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    return state
        return None

    def steps_done(self) -> int:
        """Steps taken so far (the state's 'step', which checkpoints keep)."""
        state = self.first_state()
        return 0 if state is None else int(state["step"])

    # ---- the compressed all-reduce ----
    def compressed_mean(self, key: Tensor | str, values: Tensor) -> None:
        """Replace `values` by their 1-bit error-compensated mean over the process group; `key` is the parameter
        they belong to (shaped like it) or a gradient bucket's name."""
        name = key if isinstance(key, str) else self._name_of(key)
        reduce = self._all_reduces.get(name)
        if reduce is None:
            scratch = self._shared_scratch(values)
            reduce = OneBitAllReduce(
                values.numel(), dtype=values.dtype, device=values.device, group=self.process_group, scratch=scratch
            )
            self._all_reduces[name] = reduce
            self._take_loaded(name, reduce)
        reduce(values)
        if not isinstance(key, str):
            self.apply_exp_avg_mask(key, values)

    def _name_of(self, p: Tensor) -> str:
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"{g}.{i}"
        raise ValueError(f"{self.label}.compressed_mean: the tensor of shape {tuple(p.shape)} is not a parameter here")

    # ---- the momentum mask ([Note: exp_avg_mask]) ----
    def apply_exp_avg_mask(self, p: Tensor, values: Tensor) -> None:
        """Multiply `values` (shaped like the piece `p`) by its group's `exp_avg_mask`, when the group has one."""
        group = self.param_groups[int(self._name_of(p).split(".", 1)[0])]
        mask = group.get(MASK_KEY)
        if mask is None:
            return
        cached = self._masks.get(p)
        if cached is None or cached[0] is not mask:
            cached = self._masks[p] = (mask, self._piece_mask(p, mask, group))
        values.mul_(cached[1].view_as(values))

    def _piece_mask(self, p: Tensor, mask: Tensor, group: dict[str, Any]) -> Tensor:
        """The part of the group's mask that lines up with `p`'s elements (1 where `p` holds no parameter)."""
        whole = self.whole_tensors()
        starts: dict[int, int] = {}
        totals: dict[int, int] = {}
        for number, (shape, index) in enumerate(zip(whole.shapes, whole.group_of)):
            starts[number] = totals.get(index, 0)
            totals[index] = starts[number] + math.prod(shape)
        parts = whole.parts(p)
        index = whole.group_of[parts[0].tensor] if parts else 0
        if not isinstance(mask, Tensor) or mask.numel() != totals.get(index, 0):
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"{self.label}: param group {index}'s exp_avg_mask is {shape}, but the group's parameters hold "
                f"{totals.get(index, 0)} elements; give a tensor with one entry per element of the group's "
                "parameters, flattened in their order"
            )
        flat = mask.detach().reshape(-1).to(device=p.device, dtype=p.dtype)
        out = torch.ones(p.numel(), dtype=p.dtype, device=p.device)
        for part in parts:
            start = starts[part.tensor] + part.lo
            out[part.offset : part.offset + part.numel] = flat[start : start + part.numel]
        return out

    def _slots(self) -> dict[str, int]:
        """What a compressed step compresses: name -> numel (the gradient buckets, or else every parameter)."""
        if self._gradient_buckets:
            return self._gradient_buckets
        return {
            f"{g}.{i}": p.numel() for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])
        }

    def _shared_scratch(self, values: Tensor) -> Scratch:
        """One Scratch per dtype and device, sized for the largest parameter: the all-reduces run one at a time."""
        key = (values.dtype, values.device)
        scratch = self._scratches.get(key)
        if scratch is None:
            largest = max(self._slots().values())
            size = padded_numel(max(largest, values.numel()), self._world())
            scratch = self._scratches[key] = Scratch.allocate(size, values.dtype, values.device)
        return scratch

    def owned_bytes(self) -> dict[str, int]:
        """Bytes the compressed all-reduces hold beyond `state` (zero/optimizer.py adds them to its roles): the
        error buffers are optimizer state (checkpoints keep them), the packed rows and the shared Scratch are
        communication buffers. Nothing before the first compressed step."""
        reduces = self._all_reduces.values()
        return {
            "optimizer_state": sum(r.error_bytes() for r in reduces),
            "comm_buffers": sum(r.buffer_bytes() for r in reduces) + sum(s.nbytes() for s in self._scratches.values()),
        }

    def reset_errors(self) -> None:
        for reduce in self._all_reduces.values():
            reduce.reset_errors()

    def error_buffers(self) -> dict[str, Tensor]:
        """Each all-reduce's worker and server errors, keyed '<name>.worker' / '.server' (see `_all_reduces`)."""
        out: dict[str, Tensor] = {}
        for name, reduce in self._all_reduces.items():
            out[f"{name}.worker"], out[f"{name}.server"] = reduce.worker_error, reduce.server_error
        return out

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["onebit_errors"] = {"world_size": self._world(), "buffers": self.rank_tensors()}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The moments and counters; the error buffers when saved at this world size, else zeros (logged)."""
        state_dict = dict(state_dict)
        errors = state_dict.pop("onebit_errors", None) or {"world_size": self._world(), "buffers": {}}
        saved_groups = [dict(g) for g in state_dict.get("param_groups", [])]
        for group, saved in zip(self.param_groups, saved_groups):  # the live mask, or none ([Note: exp_avg_mask])
            saved.pop(MASK_KEY, None)
            if MASK_KEY in group:
                saved[MASK_KEY] = group[MASK_KEY]
        state_dict["param_groups"] = saved_groups
        super().load_state_dict(state_dict)
        self.load_rank_tensors(errors["buffers"], saved_world_size=errors["world_size"])

    # ---- engine checkpoints: this rank's errors (checkpoint/state.py, optimizer_rank/<rank>/<name>) ----
    def rank_tensors(self) -> dict[str, Tensor]:
        """The error buffers, and each group's `exp_avg_mask` (kept, never loaded back: [Note: exp_avg_mask])."""
        out = self.error_buffers()
        for g, group in enumerate(self.param_groups):
            if isinstance(group.get(MASK_KEY), Tensor):
                out[f"group{g}.{MASK_KEY}"] = group[MASK_KEY]
        return out

    def load_rank_tensors(self, tensors: dict[str, Tensor], *, saved_world_size: int) -> None:
        """Take the errors `rank_tensors` gave at the save. They belong to this rank's place in the old world: at
        another world size (or another layout) they restart from zero, and a line says so."""
        self.reset_errors()
        self._loaded_errors.clear()
        if not tensors:
            return
        wanted = self._error_slots()
        fits = all(key in tensors and tensors[key].numel() == numel for key, numel in wanted.items())
        if saved_world_size != self._world() or not fits:
            get_logger().info(
                f"{self.label}: the checkpoint's compression errors were saved at world size {saved_world_size} "
                f"and this run has {self._world()} (or another layout); they start again from zero"
            )
            return
        for name in self._slots():
            if f"{name}.worker" in tensors:
                self._loaded_errors[name] = (tensors[f"{name}.worker"], tensors[f"{name}.server"])
        for name, reduce in self._all_reduces.items():
            self._take_loaded(name, reduce)

    def _error_slots(self) -> dict[str, int]:
        """Each error buffer's key and size at this world size (what a compressed step would build)."""
        world = self._world()
        out: dict[str, int] = {}
        for name, numel in self._slots().items():
            padded = padded_numel(numel, world)
            out[f"{name}.worker"], out[f"{name}.server"] = padded, padded // world
        return out

    def _take_loaded(self, name: str, reduce: OneBitAllReduce) -> None:
        loaded = self._loaded_errors.pop(name, None)
        if loaded is not None:
            reduce.worker_error.copy_(loaded[0])
            reduce.server_error.copy_(loaded[1])

    def _world(self) -> int:
        return dist.get_world_size(self.process_group) if dist.is_initialized() else 1
