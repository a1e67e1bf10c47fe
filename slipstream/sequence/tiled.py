"""Tiled compute along the sequence (DeepSpeed's ALST pieces): `TiledMLP`, `SequenceTiledCompute` /
`sequence_tiled_compute` and `TiledFusedLogitsLoss`.

A per-token computation (an MLP, the LM head + loss) over a long sequence keeps its intermediates for the whole
sequence alive from forward to backward: an MLP of width 4h holds several [tokens, 4h] tensors, the LM head a
[tokens, vocab] logits tensor. Tiled, the forward runs the computation on one slice of the tokens at a time
without recording a graph and keeps only its input; the backward recomputes each slice with a graph, takes
that slice's gradients and drops the slice before the next. Peak memory holds one slice's intermediates
instead of the sequence's; the price is one more forward of the computation (`TiledFusedLogitsLoss` takes
its gradients in the forward instead, so it runs once).

[Note: tiled parameter gradients] The trainable parameters of the module handed over (`TiledMLP`'s and
`TiledFusedLogitsLoss`'s `module`, the modules among `sequence_tiled_compute`'s `kwargs_to_pass`) and
`compute_params` are added as inputs of the autograd node: autograd then runs its backward even when the tiled
input needs no gradient (a first layer over frozen embeddings; DeepSpeed's functions skip the parameters'
gradients silently there), and the node returns each parameter's gradient summed over the slices, so each
arrives once per backward, as in an untiled backward (ZeRO's per-parameter hooks see one gradient, not one
per slice). A parameter the function uses that is none of those (found by walking the recomputed graph to its
leaves) gets its summed gradient by one nested `torch.autograd.backward` after the last slice. Only the
parameters a slice's graph reaches are differentiated (a module's other parameters may be sharded away at
ZeRO-3). Tensor arguments other than the tiled input are detached in the recompute: only the tiled input and
the parameters get gradients. `TiledFusedLogitsLoss` takes the gradients in its forward and returns them from
its backward multiplied by the incoming gradient (DeepSpeed applies the parameters' during the forward,
unscaled, so a loss scaled afterwards, like the weighted all-gather of sequence-parallel losses, gets wrong
LM-head gradients there).

The RNG state (CPU and accelerator) of each slice's forward is restored for its recompute, so dropout inside
the function repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from slipstream.sequence.data import slice_bounds
from slipstream.sequence.rng import RngStates

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]

_REDUCTIONS = (None, "mean", "sum")


def _graph_leaves(outputs: Sequence[torch.Tensor], exclude: set[int]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad (parameters) that `outputs` were computed from, except `exclude` (ids)."""
    seen: set[Any] = set()
    found: dict[int, torch.Tensor] = {}
    stack: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
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


def _trainable(*sources: object) -> list[torch.Tensor]:
    """The parameters requiring grad of the modules and tensor lists in `sources`, each once, in order."""
    found: dict[int, torch.Tensor] = {}
    for source in sources:
        if isinstance(source, nn.Module):
            tensors: Any = source.parameters()
        elif isinstance(source, torch.Tensor):
            tensors = [source]
        else:
            tensors = source or ()
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                found.setdefault(id(t), t)
    return list(found.values())


class _ParamGrads:
    """Parameter gradients summed over slices ([Note: tiled parameter gradients]): `inputs` are the autograd
    function's parameter inputs (their gradients are returned from its backward); parameters found only in the
    recomputed graph get theirs by one nested backward (`apply_found`)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.inputs = list(inputs)
        self.params: dict[int, torch.Tensor] = {id(p): p for p in self.inputs}
        self.sums: dict[int, torch.Tensor] = {}

    def slice_grads(
        self, output: torch.Tensor, tiled: torch.Tensor | None, upstream: torch.Tensor
    ) -> torch.Tensor | None:
        """Gradients of one slice: returned for `tiled` (None if it needs none), summed for the parameters."""
        exclude = {id(tiled)} if tiled is not None else set()
        params = _graph_leaves([output], exclude)  # only those used: a declared one may be sharded (ZeRO-3)
        for leaf in params:
            self.params.setdefault(id(leaf), leaf)
        params = [self.params[id(leaf)] for leaf in params]
        wrt = ([tiled] if tiled is not None else []) + params
        if not wrt or not output.requires_grad:
            return None
        grads = torch.autograd.grad(output, wrt, upstream, allow_unused=True)
        for param, grad in zip(params, grads[len(wrt) - len(params) :]):
            if grad is None:
                continue
            held = self.sums.get(id(param))
            self.sums[id(param)] = grad if held is None else held.add_(grad)
        return grads[0] if tiled is not None else None

    def input_grads(self, scale: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        """The summed gradients of the parameter inputs (times `scale`), in input order."""
        out = []
        for param in self.inputs:
            grad = self.sums.pop(id(param), None)
            out.append(grad if grad is None or scale is None else grad.mul_(scale.to(grad.dtype)))
        return tuple(out)

    def apply_found(self, scale: torch.Tensor | None = None) -> None:
        """Accumulate the sums of the parameters that were not inputs into their `.grad` (hooks fire once)."""
        inputs = {id(p) for p in self.inputs}
        found = [key for key in self.sums if key not in inputs]
        params = [self.params[key] for key in found]
        grads = [self.sums.pop(key) for key in found]
        grads = [g if scale is None else g.mul_(scale.to(g.dtype)) for g in grads]
        if params:
            torch.autograd.backward(params, grads)


def _device_of(*tensors: object) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _check_shards(owner: str, shards: object) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{owner}: shards must be a positive int, got {shards!r}")
    return shards


def _bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """[start, end) of each non-empty slice: `ceil(length / shards)` tokens each, the last one shorter."""
    return [(start, end) for start, end in (slice_bounds(length, r, shards) for r in range(shards)) if end > start]


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` on `shards` slices of the tokens
    of `x` ([..., tokens, hidden], every leading dim flattened with the tokens), recomputed per slice in
    backward. `fn` must treat tokens independently (an MLP does). Returns `fn(module, x)`. The trainable
    parameters of `module` (and `compute_params`) are inputs of the autograd node, so they get their gradients
    even when `x` needs none."""

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        fn: Callable[..., torch.Tensor],
        module: object,
        x: torch.Tensor,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = super().apply(fn, module, x, shards, *_trainable(module, compute_params))
        return out

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: torch.nn.Module,
        x: torch.Tensor,
        shards: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        shards = _check_shards("TiledMLP", shards)
        ctx.fn, ctx.module, ctx.params = fn, module, params
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        ctx.bounds = _bounds(rows.shape[0], shards)
        ctx.rng = RngStates(x.device)
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
        params = _ParamGrads(ctx.params)
        for index, (start, end) in enumerate(ctx.bounds):
            piece = rows[start:end].detach().requires_grad_(x_grad is not None)
            with ctx.rng.restored(index), torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            got = params.slice_grads(out, piece if x_grad is not None else None, upstream[start:end])
            if x_grad is not None:
                x_grad[start:end] = 0 if got is None else got
            del out, piece
        params.apply_found()
        return None, None, None if x_grad is None else x_grad.view_as(x), None, *params.input_grads()


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, object],
    kwargs_to_pass: dict[str, object],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """`fn(**kwargs_to_shard sliced, **kwargs_to_pass)` on `shards` slices of dim 1 (the sequence, `seqlen`
    long) of every tensor in `kwargs_to_shard`, recomputed per slice in backward (`SequenceTiledCompute`).

    The slices' outputs are concatenated along `output_unshard_dimension` (0: each slice returns a scalar, and
    they are stacked), then reduced by `output_reduction`: None (the concatenation), "mean" or "sum" (of its
    elements). Only `kwargs_to_shard[grad_requiring_tensor_key]` and the parameters `fn` uses get gradients
    (those of modules in `kwargs_to_pass` and `compute_params` as inputs of the autograd node)."""
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of "
            f"kwargs_to_shard's keys {sorted(kwargs_to_shard)}; name the sliced tensor that needs a gradient"
        )
    if output_reduction not in _REDUCTIONS:
        raise ValueError(
            f"sequence_tiled_compute: output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}"
        )
    return SequenceTiledCompute.apply(
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


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind `sequence_tiled_compute` (DeepSpeed's positional signature)."""

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: object,
    ) -> torch.Tensor:
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(
                f"SequenceTiledCompute: {len(args)} values for the {len(keys_to_shard) + len(keys_to_pass)} keys "
                f"{keys_to_shard + keys_to_pass}"
            )
        passed = args[len(keys_to_shard) :]
        params = _trainable(*(v for v in passed if isinstance(v, nn.Module)), compute_params)
        layout = (fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, len(args))
        out: torch.Tensor = super().apply(layout, output_unshard_dimension, output_reduction, *args, *params)
        return out

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, layout: tuple[Any, ...], output_unshard_dimension: int, output_reduction: str | None, *args: Any
    ) -> torch.Tensor:
        fn, seqlen, shards, keys_to_shard, keys_to_pass, key, count = layout
        shards = _check_shards("sequence_tiled_compute", shards)
        values, ctx.params = args[:count], args[count:]
        sharded = dict(zip(keys_to_shard, values[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, values[len(keys_to_shard) :]))
        for name, value in sharded.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"sequence_tiled_compute: kwargs_to_shard[{name!r}] must be a tensor [batch, seqlen={seqlen}, "
                    f"...], got {shape}"
                )
        ctx.fn, ctx.dim, ctx.reduction, ctx.key = fn, output_unshard_dimension, output_reduction, key
        ctx.index = (keys_to_shard + keys_to_pass).index(key)
        ctx.count, ctx.keys_to_shard, ctx.keys_to_pass = count, keys_to_shard, keys_to_pass
        ctx.bounds = _bounds(seqlen, shards)
        ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)))
        ctx.layout = [isinstance(v, torch.Tensor) for v in values]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in values]
        ctx.rng = RngStates(_device_of(*values))
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
        values = [next(saved) if is_tensor else other for is_tensor, other in zip(ctx.layout, ctx.others)]
        count = len(ctx.keys_to_shard)
        sharded = {k: v.detach() for k, v in zip(ctx.keys_to_shard, values[:count])}
        passed = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in zip(ctx.keys_to_pass, values[count:])}
        target = sharded[ctx.key]
        wants_grad = ctx.needs_input_grad[3 + ctx.index]
        target_grad = torch.zeros_like(target) if wants_grad else None
        params = _ParamGrads(ctx.params)
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
        params.apply_found()
        value_grads: list[torch.Tensor | None] = [None] * ctx.count
        value_grads[ctx.index] = target_grad
        return None, None, None, *value_grads, *params.input_grads()


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`: the loss
    `fn(module, x_slice, y_slice[, mask_slice])` over `shards` slices of the tokens of `x` [batch, seq, ...]
    and `y` [batch, seq, ...] (mask [batch, seq] or None), reduced by "mean" (of the slices' losses) or
    "sum". The logits of one slice exist at a time; gradients are taken in the forward, and applied in the
    backward times the incoming gradient ([Note: tiled parameter gradients])."""

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        fn: Callable[..., torch.Tensor],
        module: object,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        params = _trainable(module, compute_params)
        out: torch.Tensor = super().apply(fn, module, x, y, mask, shards, output_reduction, *params)
        return out

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        output_reduction: str,
        *params: torch.Tensor,
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
        grads = _ParamGrads(params)
        losses = []
        for start, end in bounds:
            piece = rows[start:end].detach().requires_grad_(wants_grad)
            extra = () if flat_mask is None else (flat_mask[start:end],)
            with torch.enable_grad():
                loss = fn(module, piece, targets[start:end], *extra)
            got = grads.slice_grads(loss, piece if wants_grad else None, upstream.to(loss.dtype))
            if x_grad is not None and got is not None:
                x_grad[start:end] = got
            losses.append(loss.detach())
        stacked = torch.stack(losses)
        ctx.grads, ctx.x_shape = grads, x.shape
        ctx.save_for_backward(x_grad)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x_grad,) = ctx.saved_tensors
        grads: _ParamGrads = ctx.grads
        grads.apply_found(grad)
        if x_grad is not None:
            x_grad = (x_grad * grad.to(x_grad.dtype)).view(ctx.x_shape)
        return None, None, x_grad, None, None, None, None, *grads.input_grads(grad)
