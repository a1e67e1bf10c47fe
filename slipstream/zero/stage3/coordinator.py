"""When ZeRO-3 gathers, prefetches, frees and reduces: module hooks, autograd hooks, the recorded order.

[Note: ZeRO-3 schedule]
- Forward: a unit's forward pre-hook gathers it (and the units owning parameters it borrows, e.g. a
  tied embedding) and prefetches the next units of the order recorded in the first forward, up to
  `prefetch_numel` elements and never past `max_live_numel`. Its forward post-hook frees it
  (unless something still holds it, or it is used again within `reuse_distance` elements) and hooks
  its outputs: when their gradient arrives, backward is about to need the unit, so it is gathered again.
- Inputs that require grad pass through `_BackwardMarker`, whose backward runs once the gradient of the
  unit's inputs is computed: the unit's own backward is over. A unit is freed in backward when that has
  happened for every forward call with a backward pending and all its trainable parameters have their
  gradients (for a LoRA block the adapters' gradients come before the frozen weight's last use).
- Gradients: each trainable parameter's post-accumulate-grad hook hands its gradient over and drops
  `param.grad`. Units are reduce-scattered in one fixed order (the reverse of the unit list, then the
  root and persistent units, which complete only at the end of backward), each as
  soon as it and all units before it are complete; at the end of the backward pass (an autograd
  callback) the remaining units are reduce-scattered with zeros for parameters that got no gradient on
  this rank. So every rank issues the same collectives in the same order whatever its control flow:
  unused experts and conditional branches never hang.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import Any

import torch

from slipstream.comm.errors import CollectiveError
from slipstream.utils.logging import get_logger
from slipstream.utils.torch_shim import queue_end_of_backward
from slipstream.zero.stage3.sharded_param import ZeroParamStatus, internal_access
from slipstream.zero.stage3.unit import Unit


class _BackwardMarker(torch.autograd.Function):
    """Identity on the unit's inputs; its backward reports that the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


class TrainingState(enum.Enum):
    """Where the model is in its training step; the coordinator's verbs move it (FSDP2's TrainingState)."""

    IDLE = enum.auto()
    """Between passes (or in a forward under no_grad that has ended)."""
    FORWARD = enum.auto()
    """Between the root's forward pre-hook and its forward hook (`begin_forward` -> `end_forward`)."""
    BACKWARD = enum.auto()
    """From the first gradient or pre-backward hook to the end-of-backward callback (`end_backward`). Forward
    hooks that fire here are activation checkpointing's recomputation."""


@dataclasses.dataclass
class OrderTrace:
    """The unit order of one kind of pass: recorded during the first such pass, then replayed to prefetch."""

    order: list[int] = dataclasses.field(default_factory=list)
    recording: bool = True
    position: int = 0
    """While replaying: the index after the last unit seen this pass (len(order) + 1 once the order is lost)."""

    def restart(self) -> None:
        self.position = 0

    def visit(self, uids: list[int]) -> bool:
        """The pass reached `uids[0]` (with the units it borrows); True when replaying (prefetch from here)."""
        if self.recording:
            self.order.extend(uids)
            return False
        for index in range(self.position, len(self.order)):
            if self.order[index] == uids[0]:
                self.position = index + 1
                return True
        self.position = len(self.order) + 1
        return True

    def seal(self) -> None:
        """The first pass is over: from now on the order is replayed."""
        if self.recording and self.order:
            self.recording = False

    def upcoming(self) -> list[int]:
        return self.order[self.position :]


@dataclasses.dataclass
class _UnitState:
    """Per-unit bookkeeping of the coordinator (reset at the end of each backward pass)."""

    borrow: list[Unit]
    """The unit first, then the units owning parameters its modules use."""
    holds: int = 0
    """Forward calls in progress plus explicit holds (GatheredParameters, generation)."""
    backward_open: int = 0
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Gradients not yet packed for the reduce-scatter (the reducer empties it when it launches)."""
    received: set[int] = dataclasses.field(default_factory=set)
    expected: frozenset[int] = frozenset()


def _after_forward(cleanup: Callable[[], None], output: object) -> None:
    """Run a forward hook's `cleanup` (release gathered units). torch runs these hooks (always_call) also when
    the forward raised, inside its `except` clause and with no output: a collective that fails during the
    cleanup then is the same fault as the error already on its way up (a peer lost or stopped), and raising it
    would only print it once more as torch's warning. Other errors are raised as always."""
    failing = output is None and sys.exc_info()[1] is not None
    try:
        cleanup()
    except CollectiveError:
        if not failing:
            raise


class Coordinator:
    """Drives the units of one ZeroModel (see [Note: ZeRO-3 schedule])."""

    def __init__(
        self,
        units: list[Unit],
        borrow: dict[int, list[Unit]],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        reuse_distance: int,
    ) -> None:
        self.units = units
        self._by_uid = {u.uid: u for u in units}
        self.state = {u.uid: _UnitState(borrow=borrow.get(u.uid, [u])) for u in units}
        self.prefetch_numel, self.max_live_numel, self.reuse_distance = prefetch_numel, max_live_numel, reuse_distance
        self.reducer: Any = None
        """The Stage3Optimizer when training; it owns gradient storage and the reduce-scatter."""
        self.forward_trace, self.backward_trace = OrderTrace(), OrderTrace()
        self.training_state = TrainingState.IDLE
        self.hooks: list[Any] = []
        self._running: list[Unit] = []
        """Units whose forward is running, innermost last (a parameter used there is borrowed by the last)."""
        self.paused = False
        """The forward hooks do nothing (every unit is held gathered for a generate: generation.py)."""

    # ---- registration ----
    def attach(self, root: torch.nn.Module) -> None:
        self.hooks.append(
            root.register_forward_pre_hook(lambda m, a: None if self.paused else self.begin_forward(), prepend=True)
        )
        self.hooks.append(
            root.register_forward_hook(
                lambda m, a, o: None if self.paused else _after_forward(self.end_forward, o), always_call=True
            )
        )
        for unit in self.units:
            if unit.module is None:
                continue
            self.hooks.append(unit.module.register_forward_pre_hook(self._make_pre(unit), with_kwargs=True))
            self.hooks.append(unit.module.register_forward_hook(self._make_post(unit), always_call=True))

    def watch_gradients(self, reducer: object, trainable: dict[int, frozenset[int]]) -> None:
        """Hand trainable parameters' gradients to `reducer`; `trainable` maps unit uid -> parameter indices."""
        self.reducer = reducer
        for unit in self.units:
            indices = trainable.get(unit.uid, frozenset())
            self.state[unit.uid].expected = indices
            for index in indices:
                self.hooks.append(
                    unit.params[index].register_post_accumulate_grad_hook(self._make_grad_hook(unit, index))
                )

    def detach(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def _make_pre(self, unit: Unit) -> Any:
        def hook(module: object, args: object, kwargs: object) -> Any:
            if self.paused:
                return None
            self.pre_forward(unit)
            if not torch.is_grad_enabled():
                return None
            return self._mark_inputs(unit, args, kwargs)

        return hook

    def _make_post(self, unit: Unit) -> Any:
        def hook(module: object, args: object, output: object) -> Any:
            if not self.paused:
                _after_forward(lambda: self.post_forward(unit, output), output)
            return None

        return hook

    def _make_grad_hook(self, unit: Unit, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            with internal_access():
                grad = param.grad
                param.grad = None
            if grad is not None:  # nn.Embedding(sparse=True) gives its rows: reduced as a dense gradient
                self.gradient_arrived(unit, index, grad.to_dense() if grad.is_sparse else grad)

        return hook

    # ---- forward ----
    def begin_forward(self) -> None:
        if self.training_state is TrainingState.IDLE:
            self.training_state = TrainingState.FORWARD
        self.forward_trace.restart()

    def end_forward(self) -> None:
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE
        self.forward_trace.seal()
        for unit in self.units:  # prefetched but not used this pass (the order changed)
            if self.state[unit.uid].holds == 0 and unit.status is ZeroParamStatus.INFLIGHT:
                unit.release()

    def pre_forward(self, unit: Unit) -> None:
        self._running.append(unit)
        state = self.state[unit.uid]
        for owner in state.borrow:
            owner.finish_gather(hook=True)
            self.state[owner.uid].holds += 1
            owner.active_modules.add(unit.uid)
        # borrowed units are recorded too: a tied embedding used again by the head is "reused"
        if self.forward_trace.visit([owner.uid for owner in state.borrow]):
            self._prefetch(self.forward_trace.upcoming())

    def post_forward(self, unit: Unit, output: object) -> None:
        if unit in self._running:
            del self._running[len(self._running) - 1 - self._running[::-1].index(unit)]
        state = self.state[unit.uid]
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            fired = [False]

            def before_backward(grad: torch.Tensor) -> None:
                if not fired[0]:
                    fired[0] = True
                    self.pre_backward(unit)

            for tensor in outputs:
                tensor.register_hook(before_backward)
        for owner in state.borrow:
            self.state[owner.uid].holds -= 1
            owner.active_modules.discard(unit.uid)
            # During backward (activation checkpointing recomputes the forward), the backward frees the unit.
            in_backward = self.training_state is TrainingState.BACKWARD
            if self.state[owner.uid].holds == 0 and not in_backward and not self._reused_soon(owner):
                owner.release()

    def borrow_on_use(self, owner: Unit, name: str) -> bool:
        """A parameter of `owner` is used, not gathered, inside the forward of another unit (`F.linear(x,
        self.other.weight)` in a parent's forward): `owner` becomes one of that unit's borrowed units, as
        `register_external_parameter` would have said up front, and is gathered now. From then on it is gathered
        with the unit (forward, and backward, which needs it again) and released with it. False outside any
        unit's forward (the caller raises). Every rank runs the same forward, so every rank gathers alike."""
        if not self._running:
            return False
        user = self._running[-1]
        borrow = self.state[user.uid].borrow
        if owner not in borrow:
            borrow.append(owner)
            get_logger().info(
                "ZeRO-3: '%s' (unit %s) is used in the forward of unit %s; it is gathered with that unit from now on "
                "(register_external_parameter(module, param) declares it up front)",
                name,
                owner.name,
                user.name,
            )
        owner.finish_gather(hook=True)  # starts the gather too
        self.state[owner.uid].holds += 1  # released by the user's forward hook, with its other borrowed units
        owner.active_modules.add(user.uid)
        return True

    def _mark_inputs(self, unit: Unit, args: Any, kwargs: Any) -> Any:
        positions = [(True, i) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        positions += [(False, k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return None
        owners = self.state[unit.uid].borrow
        for owner in owners:
            self.state[owner.uid].backward_open += 1

        def done() -> None:
            for owner in owners:
                state = self.state[owner.uid]
                state.backward_open = max(0, state.backward_open - 1)
                self._maybe_release_after_backward(owner)

        tensors = [args[key] if positional else kwargs[key] for positional, key in positions]
        marked = _BackwardMarker.apply(done, *tensors)
        marked = (marked,) if isinstance(marked, torch.Tensor) else marked
        args, kwargs = list(args), dict(kwargs)
        for (positional, key), tensor in zip(positions, marked):
            if positional:
                args[key] = tensor
            else:
                kwargs[key] = tensor
        return tuple(args), kwargs

    # ---- backward ----
    def _begin_backward_pass(self) -> None:
        if self.training_state is not TrainingState.BACKWARD:
            self.training_state = TrainingState.BACKWARD
            self.backward_trace.restart()
            queue_end_of_backward(self.end_backward)

    def pre_backward(self, unit: Unit) -> None:
        self._begin_backward_pass()
        for owner in self.state[unit.uid].borrow:
            owner.finish_gather(hook=True)
        if self.backward_trace.visit([unit.uid]):
            self._prefetch(self.backward_trace.upcoming())

    def gradient_arrived(self, unit: Unit, index: int, grad: torch.Tensor) -> None:
        self._begin_backward_pass()
        state = self.state[unit.uid]
        if index in state.received and index not in state.grads:
            raise RuntimeError(
                f"ZeRO-3 got a second gradient for '{unit.records[index].name}' in one backward pass after its unit "
                f"'{unit.name}' was already reduced; combine the losses before one backward call"
            )
        state.grads[index] = state.grads[index] + grad if index in state.grads else grad
        state.received.add(index)
        if len(state.received) == len(state.expected):
            self.reducer.unit_ready(unit, state.grads)
            self._maybe_release_after_backward(unit)

    def _maybe_release_after_backward(self, unit: Unit) -> None:
        state = self.state[unit.uid]
        if state.holds or state.backward_open or len(state.received) < len(state.expected):
            return
        unit.release()

    def end_backward(self) -> None:
        """End of a backward pass: reduce what is left (zeros for missing gradients), free, reset."""
        self.training_state = TrainingState.IDLE
        self.backward_trace.seal()
        if self.reducer is not None:
            self.reducer.flush({uid: s.grads for uid, s in self.state.items()})
        for unit in self.units:
            state = self.state[unit.uid]
            state.grads = {}
            state.received = set()
            state.backward_open = 0
            if state.holds == 0:
                unit.release()

    # ---- order and prefetch ----
    def _prefetch(self, upcoming: list[int]) -> None:
        budget = self.prefetch_numel
        live = sum(
            u.layout.full_numel
            for u in self.units
            if u.status is not ZeroParamStatus.NOT_AVAILABLE and not u.persistent
        )
        for uid in upcoming:
            unit = self._by_uid[uid]
            if unit.status is not ZeroParamStatus.NOT_AVAILABLE:
                continue
            size = unit.layout.full_numel
            if size > budget or live + size > self.max_live_numel:
                break
            unit.start_gather(hook=True)
            budget -= size
            live += size

    def _reused_soon(self, unit: Unit) -> bool:
        if self.forward_trace.recording or self.reuse_distance <= 0:
            return False
        distance = 0
        for uid in self.forward_trace.upcoming():
            if uid == unit.uid:
                return True
            distance += self._by_uid[uid].layout.full_numel
            if distance > self.reuse_distance:
                return False
        return False


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _tensors(value.to_tuple())
    return []
