"""Tiled compute along the sequence (DeepSpeed's ALST pieces): `TiledMLP`, `SequenceTiledCompute` /
`sequence_tiled_compute` and `TiledFusedLogitsLoss`.

A per-token computation (an MLP, the LM head + loss) over a long sequence keeps its intermediates for the whole
sequence alive from forward to backward: an MLP of width 4h holds several [tokens, 4h] tensors, the LM head a
[tokens, vocab] logits tensor. Tiled, the forward runs the computation on one slice of the tokens at a time
without recording a graph and keeps only its input; the backward recomputes each slice with a graph, takes
that slice's gradients and drops the slice before the next. Peak memory holds one slice's intermediates
instead of the sequence's; the price is one more forward of the computation (`TiledFusedLogitsLoss` takes
its gradients in the forward instead, so it runs once).

[Note: tiled parameter gradients] The parameters the computation uses receive their gradient once, summed
over the slices, by one `torch.autograd.backward(params, summed)` after the last slice (their gradient hooks
fire once, as in an untiled backward, so ZeRO's per-parameter hooks see one gradient per step, not one per
slice). They are found by walking each slice's recomputed graph to its leaves: every parameter the function
touches is included (`compute_params` is accepted for DeepSpeed's signature and added to them). Tensor
arguments other than the tiled input are detached in the recompute: only the tiled input and the parameters
get gradients. `TiledFusedLogitsLoss` keeps the summed parameter gradients from its forward and applies them
in its backward multiplied by the incoming gradient (DeepSpeed applies them during the forward, unscaled, so a
loss that is scaled afterwards, like the weighted all-gather of sequence-parallel losses, gets wrong LM-head
gradients there).

The RNG state (CPU and accelerator) of each slice's forward is restored for its recompute, so dropout inside
the function repeats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]

_REDUCTIONS = (None, "mean", "sum")


class _RngStates:
    """The RNG state before each slice's forward, restored for that slice's recompute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = getattr(torch, device.type, None) if device.type != "cpu" else None
        self.states: list[tuple[torch.Tensor, Any]] = []

    def record(self) -> None:
        device_state = self.module.get_rng_state(self.device) if self.module is not None else None
        self.states.append((torch.get_rng_state(), device_state))

    @contextmanager
    def restored(self, index: int) -> Iterator[None]:
        cpu_state, device_state = self.states[index]
        forked = [self.device] if device_state is not None else []
        with torch.random.fork_rng(devices=forked, device_type=self.device.type):
            torch.set_rng_state(cpu_state)
            if device_state is not None and self.module is not None:
                self.module.set_rng_state(device_state, self.device)
            yield


def _graph_leaves(outputs: Sequence[torch.Tensor], exclude: set[int]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad (parameters) that `outputs` were computed from, except `exclude` (ids)."""
    seen: set[Any] = set()
    found: dict[int, torch.Tensor] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            if id(variable) not in exclude:
                found.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


class _ParamGrads:
    """Parameter gradients summed over slices ([Note: tiled parameter gradients])."""

    def __init__(self, declared: Sequence[torch.Tensor] | None) -> None:
        self.params: dict[int, torch.Tensor] = {id(p): p for p in declared or () if p.requires_grad}
        self.sums: dict[int, torch.Tensor] = {}

    def slice_grads(
        self, output: torch.Tensor, tiled: torch.Tensor | None, upstream: torch.Tensor
    ) -> torch.Tensor | None:
        """Gradients of one slice: returned for `tiled` (None if it needs none), summed for the parameters."""
        exclude = {id(tiled)} if tiled is not None else set()
        for leaf in _graph_leaves([output], exclude):
            self.params.setdefault(id(leaf), leaf)
        params = list(self.params.values())
        inputs = ([tiled] if tiled is not None else []) + params
        if not inputs:
            return None
        grads = torch.autograd.grad(output, inputs, upstream, allow_unused=True)
        for param, grad in zip(params, grads[len(inputs) - len(params) :]):
            if grad is None:
                continue
            held = self.sums.get(id(param))
            self.sums[id(param)] = grad if held is None else held.add_(grad)
        return grads[0] if tiled is not None else None

    def apply(self, scale: torch.Tensor | None = None) -> None:
        """Accumulate the sums into the parameters' `.grad` (their hooks fire once); `scale` multiplies them."""
        params = [self.params[key] for key in self.sums]
        grads = [g if scale is None else g.mul_(scale.to(g.dtype)) for g in self.sums.values()]
        self.sums = {}
        if params:
            torch.autograd.backward(params, grads)


def _device_of(*tensors: Any) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _check_shards(owner: str, shards: Any) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{owner}: shards must be a positive int, got {shards!r}")
    return shards


def _bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """[start, end) of each non-empty slice: `ceil(length / shards)` tokens each, the last one shorter."""
    step = max(1, math.ceil(length / shards))
    return [(start, min(start + step, length)) for start in range(0, length, step)]


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` on `shards` slices of the tokens
    of `x` ([..., tokens, hidden], every leading dim flattened with the tokens), recomputed per slice in
    backward. `fn` must treat tokens independently (an MLP does). Returns `fn(module, x)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        shards = _check_shards("TiledMLP", shards)
        ctx.fn, ctx.module, ctx.compute_params = fn, module, list(compute_params or [])
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        ctx.bounds = _bounds(rows.shape[0], shards)
        ctx.rng = _RngStates(x.device)
        pieces = []
        for start, end in ctx.bounds:
            ctx.rng.record()
            pieces.append(fn(module, rows[start:end]))
        out = torch.cat(pieces) if len(pieces) != 1 else pieces[0]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        rows = x.detach().reshape(-1, x.shape[-1])
        upstream = grad.reshape(rows.shape[0], -1)
        x_grad = torch.empty_like(rows) if ctx.needs_input_grad[2] else None
        params = _ParamGrads(ctx.compute_params)
        for index, (start, end) in enumerate(ctx.bounds):
            piece = rows[start:end].detach().requires_grad_(x_grad is not None)
            with ctx.rng.restored(index), torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            got = params.slice_grads(out, piece if x_grad is not None else None, upstream[start:end])
            if x_grad is not None:
                x_grad[start:end] = 0 if got is None else got
            del out, piece
        params.apply()
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """`fn(**kwargs_to_shard sliced, **kwargs_to_pass)` on `shards` slices of dim 1 (the sequence, `seqlen`
    long) of every tensor in `kwargs_to_shard`, recomputed per slice in backward (`SequenceTiledCompute`).

    The slices' outputs are concatenated along `output_unshard_dimension` (0: each slice returns a scalar, and
    they are stacked), then reduced by `output_reduction`: None (the concatenation), "mean" or "sum" (of its
    elements). Only `kwargs_to_shard[grad_requiring_tensor_key]` and the parameters `fn` uses get gradients."""
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of "
            f"kwargs_to_shard's keys {sorted(kwargs_to_shard)}; name the sliced tensor that needs a gradient"
        )
    if output_reduction not in _REDUCTIONS:
        raise ValueError(
            f"sequence_tiled_compute: output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}"
        )
    out: torch.Tensor = SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )
    return out


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind `sequence_tiled_compute` (DeepSpeed's positional signature)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> torch.Tensor:
        shards = _check_shards("sequence_tiled_compute", shards)
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(
                f"SequenceTiledCompute: {len(args)} values for {len(keys_to_shard) + len(keys_to_pass)} keys"
            )
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :]))
        for key, value in sharded.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a tensor [batch, seqlen={seqlen}, "
                    f"...], got {shape}"
                )
        ctx.fn, ctx.dim, ctx.reduction = fn, output_unshard_dimension, output_reduction
        ctx.key, ctx.compute_params = grad_requiring_tensor_key, list(compute_params or [])
        ctx.index = (keys_to_shard + keys_to_pass).index(grad_requiring_tensor_key)
        ctx.count = len(args)
        ctx.bounds = _bounds(seqlen, shards)
        ctx.keys_to_shard, ctx.keys_to_pass = keys_to_shard, keys_to_pass
        tensors = [v for v in args if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(v, torch.Tensor) for v in args]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in args]
        ctx.rng = _RngStates(_device_of(*args))
        pieces, ctx.shapes = [], []
        for start, end in ctx.bounds:
            ctx.rng.record()
            piece = fn(**{k: v[:, start:end] for k, v in sharded.items()}, **passed)
            if output_unshard_dimension == 0:
                piece = piece.reshape(1, *piece.shape)
            ctx.shapes.append(piece.shape)
            pieces.append(piece)
        out = torch.cat(pieces, dim=output_unshard_dimension)
        ctx.numel = out.numel()
        if output_reduction == "mean":
            return out.mean()
        if output_reduction == "sum":
            return out.sum()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if is_tensor else other for is_tensor, other in zip(ctx.layout, ctx.others)]
        count = len(ctx.keys_to_shard)
        sharded = {k: v.detach() for k, v in zip(ctx.keys_to_shard, args[:count])}
        passed = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in zip(ctx.keys_to_pass, args[count:])}
        target = sharded[ctx.key]
        wants_grad = ctx.needs_input_grad[9 + ctx.index]
        target_grad = torch.zeros_like(target) if wants_grad else None
        params = _ParamGrads(ctx.compute_params)
        offset = 0
        for index, (start, end) in enumerate(ctx.bounds):
            shape = ctx.shapes[index]
            if ctx.reduction is None:
                upstream = grad.narrow(ctx.dim, offset, shape[ctx.dim])
                offset += shape[ctx.dim]
            else:
                scale = grad / ctx.numel if ctx.reduction == "mean" else grad
                upstream = scale.expand(shape)
            inputs = {k: v[:, start:end] for k, v in sharded.items()}
            inputs[ctx.key] = inputs[ctx.key].detach().requires_grad_(wants_grad)
            with ctx.rng.restored(index), torch.enable_grad():
                out = ctx.fn(**inputs, **passed).reshape(shape)
            got = params.slice_grads(out, inputs[ctx.key] if wants_grad else None, upstream)
            if target_grad is not None and got is not None:
                target_grad[:, start:end] = got
            del out, inputs
        params.apply()
        arg_grads: list[torch.Tensor | None] = [None] * ctx.count
        arg_grads[ctx.index] = target_grad
        return (None,) * 9 + tuple(arg_grads)


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`: the loss
    `fn(module, x_slice, y_slice[, mask_slice])` over `shards` slices of the tokens of `x` [batch, seq, ...]
    and `y` [batch, seq, ...] (mask [batch, seq] or None), reduced by "mean" (of the slices' losses) or
    "sum". The logits of one slice exist at a time; gradients are taken in the forward, and applied in the
    backward times the incoming gradient ([Note: tiled parameter gradients])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        shards = _check_shards("TiledFusedLogitsLoss", shards)
        if output_reduction not in ("mean", "sum"):
            raise ValueError(
                f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}"
            )
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"TiledFusedLogitsLoss: x and y must be [batch, seq, ...] with the same batch and seq, got "
                f"x {tuple(x.shape)} and y {tuple(y.shape)}"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"TiledFusedLogitsLoss: mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
            )
        wants_grad = ctx.needs_input_grad[2]
        rows = x.detach().reshape(-1, *x.shape[2:])
        targets = y.reshape(-1, *y.shape[2:])
        flat_mask = None if mask is None else mask.reshape(-1)
        bounds = _bounds(rows.shape[0], shards)
        upstream = torch.tensor(1.0 / len(bounds) if output_reduction == "mean" else 1.0, device=x.device)
        x_grad = torch.zeros_like(rows) if wants_grad else None
        params = _ParamGrads(compute_params)
        losses = []
        for start, end in bounds:
            piece = rows[start:end].detach().requires_grad_(wants_grad)
            extra = () if flat_mask is None else (flat_mask[start:end],)
            with torch.enable_grad():
                loss = fn(module, piece, targets[start:end], *extra)
            if loss.requires_grad:
                got = params.slice_grads(loss, piece if wants_grad else None, upstream.to(loss.dtype))
                if x_grad is not None and got is not None:
                    x_grad[start:end] = got
            losses.append(loss.detach())
        stacked = torch.stack(losses)
        ctx.params, ctx.x_shape = params, x.shape
        ctx.save_for_backward(x_grad)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x_grad,) = ctx.saved_tensors
        ctx.params.apply(grad)
        if x_grad is not None:
            x_grad = (x_grad * grad.to(x_grad.dtype)).view(ctx.x_shape)
        return None, None, x_grad, None, None, None, None, None
