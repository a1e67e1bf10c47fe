"""Runs one batch's actions (pipe/schedule.py) on this pipeline stage: forwards, backwards (whole, or split
into input- and weight-gradient parts), the exchange of activations and gradients, the losses.

A forward of virtual stage s takes its input from the data (s = 0), from a local hand-off (stage s-1 runs
on this rank too) or from the owner of s-1; its output goes to the loss (last stage), a local hand-off or the
owner of s+1. Received floating-point tensors are leaves that require grad, so the backward of s has their
gradients to send back. Any exception here is recorded in the store and raised as `PipelineStageError`
naming the stage, the rank and the action; a peer waiting on this stage then fails within the collective
timeout with the same names (comm/p2p.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import p2p
from slipstream.pipe.exchange import Exchanger, flatten
from slipstream.pipe.module import PipelineModule
from slipstream.pipe.schedule import Action
from slipstream.utils import torch_shim


class PipelineStageError(RuntimeError):
    """A pipeline stage failed (its own error, or a peer's, named with stage and rank)."""


def _grad_leaves(tree: object) -> Any:
    """The tree with each tensor detached; floating-point ones become leaves that require grad."""
    spec, tensors = flatten(tree)
    from slipstream.pipe.exchange import unflatten

    fresh = [t.detach().requires_grad_(t.is_floating_point() and t.requires_grad) for t in tensors]
    return unflatten(spec, fresh)


def _needing_grad(tree: object) -> list[torch.Tensor]:
    return [t for t in flatten(tree)[1] if t.requires_grad]


class StageRunner:
    """Executes actions for one PipelineModule; one instance per engine, reused every batch."""

    def __init__(
        self,
        module: PipelineModule,
        exchanger: Exchanger,
        *,
        ranks_of_stage: Callable[[int], int],
        after_backward: Callable[[Any], None],
    ) -> None:
        self.module, self.exchanger = module, exchanger
        self.ranks_of_stage = ranks_of_stage
        self.after_backward = after_backward
        self.last = module.num_virtual_stages - 1
        self.rank = dist.get_rank()
        self._weights = {
            v: _unique([p for _, f in module.chunk_funcs[v] for p in _params(f) if p.requires_grad])
            for v in module.local_virtual
        }

    def _peer(self, virtual: int) -> int | None:
        owner = self.module.stage_owner(virtual)
        return None if owner == self.module.stage_id else self.ranks_of_stage(owner)

    def _what(self, verb: str, stage: int, micro: int) -> str:
        return f"pipeline stage {self.module.stage_id} (rank {self.rank}): {verb} of virtual stage {stage}, micro-batch {micro}"

    def run(
        self, actions: list[Action], inputs: list[object], labels: list[object], *, train: bool
    ) -> list[torch.Tensor]:
        """Run `actions`; return the last stage's per-micro-batch losses (outputs when there is no loss_fn)."""
        self.saved: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.local: dict[tuple[str, int, int], Any] = {}
        self.split: dict[tuple[int, int], Any] = {}
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        try:
            for action in actions:
                if action.kind == "F":
                    self._forward(action, inputs, labels, train=train)
                else:
                    self._backward(action)
            self.exchanger.flush()
        except p2p.PointToPointError as exc:
            raise PipelineStageError(f"pipeline stage {self.module.stage_id} on rank {self.rank}: {exc}") from None
        except Exception as exc:
            text = f"stage {self.module.stage_id} (rank {self.rank}) raised {type(exc).__name__}: {exc}"
            p2p.note_failure(text[:2000])
            raise PipelineStageError(
                f"pipeline stage {self.module.stage_id} on rank {self.rank} failed in {action.kind} of virtual "
                f"stage {action.stage}, micro-batch {action.micro}: {type(exc).__name__}: {exc}"
            ) from exc
        return [self.losses[m] for m in sorted(self.losses)]

    def _forward(self, action: Action, inputs: list[object], labels: list[object], *, train: bool) -> None:
        s, m = action.stage, action.micro
        if s == 0:
            x = inputs[m]
        else:
            peer = self._peer(s - 1)
            if peer is None:
                x = self.local.pop(("act", s - 1, m))
            else:
                x = self.exchanger.recv(
                    src=peer, direction="act", stage=s - 1, micro=m, what=self._what("receive of the input", s, m)
                )
        with torch.set_grad_enabled(train):
            out = self.module.run_chunk(s, x)
            if s == self.last:
                loss_fn = self.module.loss_fn
                out = loss_fn(out, labels[m]) if loss_fn is not None else out
        if s == self.last:
            self.losses[m] = out
        else:
            peer = self._peer(s + 1)
            if peer is None:
                self.local[("act", s, m)] = _grad_leaves(out) if train else out
            else:
                self.exchanger.send(
                    out, dst=peer, direction="act", stage=s, micro=m, what=self._what("send of the output", s, m)
                )
        if train:
            self.saved[(s, m)] = (x, out)

    def _output_grads(self, s: int, m: int) -> list[torch.Tensor] | None:
        if s == self.last:
            return None
        peer = self._peer(s + 1)
        if peer is None:
            grads: list[torch.Tensor] = self.local.pop(("grad", s, m))
            return grads
        got = self.exchanger.recv(
            src=peer, direction="grad", stage=s, micro=m, what=self._what("receive of the output gradient", s, m)
        )
        return list(got)

    def _send_input_grads(self, s: int, m: int, x: object) -> None:
        if s == 0:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _needing_grad(x)]
        peer = self._peer(s - 1)
        if peer is None:
            self.local[("grad", s - 1, m)] = grads
        else:
            self.exchanger.send(
                grads,
                dst=peer,
                direction="grad",
                stage=s - 1,
                micro=m,
                what=self._what("send of the input gradient", s, m),
            )

    def _backward(self, action: Action) -> None:
        s, m = action.stage, action.micro
        if action.kind == "W":
            weights = self._weights[s]
            kind, state = self.split.pop((s, m))
            if kind == "whole":  # nothing upstream needed gradients: the whole backward runs here
                torch.autograd.backward(*state)
                self.after_backward(None)
            else:
                torch_shim.backward_weight(weights, state)
                self.after_backward(weights)
            return
        x, out = self.saved.pop((s, m))
        grads = self._output_grads(s, m)
        outputs = [out] if s == self.last else _needing_grad(out)
        if grads is not None and len(grads) != len(outputs):
            raise RuntimeError(
                f"stage output has {len(outputs)} tensors that need gradients but {len(grads)} "
                "gradients arrived: the stage's output structure changed between forward and backward"
            )
        if action.kind == "I":
            inputs = _needing_grad(x)
            if inputs:
                self.split[(s, m)] = ("split", torch_shim.backward_input(outputs, grads, inputs, self._weights[s]))
            else:  # as torch's stage does for its first stage: no input gradient, all of it in W
                self.split[(s, m)] = ("whole", (outputs, grads))
        elif outputs:
            torch.autograd.backward(outputs, grads)
        self._send_input_grads(s, m, x)
        if action.kind == "B":
            self.after_backward(None)


def _params(func: object) -> list[torch.nn.Parameter]:
    """The parameters a layer function uses (a module, or a tied forward_fn bound to its module)."""
    module = func.args[0] if isinstance(func, functools.partial) and func.args else func
    return list(module.parameters()) if isinstance(module, torch.nn.Module) else []


def _unique(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: dict[int, torch.nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())
