"""Pure-PyTorch `cpu_adam`: the native module's functions, on torch's own fused (or foreach) Adam kernel.

Same interface as slipstream/ops/csrc/adam/cpu_adam.cpp (the two are tested against each other). Used when no compiler is available
or with SLIPSTREAM_OPS=fallback. It also owns `adam_update_any_dtype`, the general path the optimizer uses for
states the native kernel does not take (fp32_optimizer_states=False, fp16 params).

[Note: fallback bias correction] torch's Adam always applies bias correction. With bias_correction=False the
update p -= lr * m / (sqrt(v) + eps) is obtained from torch's p -= (lr'/bc1) * m / (sqrt(v)/bc2s + eps') by
lr' = lr * bc1 / bc2s and eps' = eps / bc2s (bc1 = 1 - beta1^t, bc2s = sqrt(1 - beta2^t)); AdamW's decay
p *= 1 - lr'*wd' keeps its value with wd' = wd * lr / lr' (L2 decay, g += wd * p, is unchanged).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_ANY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Mixed-dtype tensors are upcast in batches of at most this many fp32 scratch elements (256 MiB).
_SCRATCH_BATCH = 1 << 26


def simd_level() -> str:
    """Always 'fallback' (the native module reports its SIMD level)."""
    return "fallback"


class AdamHyper(NamedTuple):
    """One Adam step's scalars, in the order the native `adam_update` takes them after the four tensor lists."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    adamw_mode: bool


def adam_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    adamw_mode: bool,
    low_precision_out: list[Tensor],
) -> None:
    """In-place Adam/AdamW; params fp32 or bf16, grads in the param dtype, states fp32 (the native op's interface)."""
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, low_precision_out)
    for i, (p, _grad, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"cpu_adam.adam_update: params[{i}] has dtype {p.dtype}; supported param dtypes "
                "are float32 and bfloat16"
            )
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError(
                f"cpu_adam.adam_update: exp_avgs[{i}] and exp_avg_sqs[{i}] must be float32, got {m.dtype} and {v.dtype}"
            )
    hyper = AdamHyper(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode)
    adam_update_any_dtype(params, grads, exp_avgs, exp_avg_sqs, hyper, low_precision_out, _checked=True)


def adam_update_any_dtype(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    hyper: AdamHyper,
    low_precision_out: list[Tensor],
    *,
    _checked: bool = False,
) -> None:
    """`adam_update` for any float32/bfloat16/float16 mix: math in fp32, results rounded on store."""
    if not _checked:
        _check_lists(params, grads, exp_avgs, exp_avg_sqs, low_precision_out)
        for i, t in enumerate(params + exp_avgs + exp_avg_sqs):
            if t.dtype not in _ANY_DTYPES:
                raise TypeError(f"cpu_adam: tensor {i} has dtype {t.dtype}; use float32, bfloat16 or float16")
    if hyper.step < 1:
        raise ValueError(f"cpu_adam.adam_update: step must be the 1-based step count (>= 1), got {hyper.step}")
    torch_hyper = _torch_hyper(hyper)
    outs: list[Tensor | None] = list(low_precision_out) if low_precision_out else [None] * len(params)
    nonempty = [i for i, p in enumerate(params) if p.numel() > 0]
    direct = [i for i in nonempty if _all_fp32(params[i], exp_avgs[i], exp_avg_sqs[i])]
    mixed = [i for i in nonempty if not _all_fp32(params[i], exp_avgs[i], exp_avg_sqs[i])]
    if direct:
        _torch_adam(
            [params[i] for i in direct],
            [grads[i] for i in direct],
            [exp_avgs[i] for i in direct],
            [exp_avg_sqs[i] for i in direct],
            step=hyper.step,
            adamw_mode=hyper.adamw_mode,
            **torch_hyper,
        )
        for i in direct:
            _copy_out(outs[i], params[i])
    for batch in _batches(mixed, params):
        _update_upcast(batch, params, grads, exp_avgs, exp_avg_sqs, outs, hyper=hyper, torch_hyper=torch_hyper)


def _update_upcast(
    batch: list[int],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    outs: list[Tensor | None],
    *,
    hyper: AdamHyper,
    torch_hyper: dict[str, float],
) -> None:
    """Upcasts the non-fp32 tensors of `batch` into one reused fp32 scratch, updates, and rounds back."""
    # grads share the param dtype, so a non-fp32 param needs two slices (param and grad).
    need = sum(
        params[i].numel() * sum(t.dtype != torch.float32 for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))
        for i in batch
    )
    scratch = _scratch(need)
    offset = 0

    def as_fp32(t: Tensor) -> Tensor:
        nonlocal offset
        if t.dtype == torch.float32:
            return t.view(-1)
        view = scratch[offset : offset + t.numel()]
        offset += t.numel()
        return view.copy_(t.reshape(-1))

    ps, gs, ms, vs = [], [], [], []
    for i in batch:
        ps.append(as_fp32(params[i]))
        gs.append(as_fp32(grads[i]))
        ms.append(as_fp32(exp_avgs[i]))
        vs.append(as_fp32(exp_avg_sqs[i]))
    _torch_adam(ps, gs, ms, vs, step=hyper.step, adamw_mode=hyper.adamw_mode, **torch_hyper)
    for k, i in enumerate(batch):
        for dst, src in ((params[i], ps[k]), (exp_avgs[i], ms[k]), (exp_avg_sqs[i], vs[k])):
            if dst.dtype != torch.float32:
                dst.view(-1).copy_(src)
        _copy_out(outs[i], ps[k])


def _torch_adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    adamw_mode: bool,
    lr: float,
    eps: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
) -> None:
    """One call of torch's functional Adam/AdamW on same-dtype tensor lists at step `step`."""
    fused = _fused_supported()
    # torch increments these itself before use, so they start at step - 1.
    steps = [torch.tensor(float(step - 1), dtype=torch.float32) for _ in params]
    kwargs: dict[str, Any] = dict(
        foreach=None if fused else True,
        capturable=False,
        differentiable=False,
        fused=True if fused else None,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
    if adamw_mode and not _has_decoupled_flag():
        from torch.optim.adamw import adamw as torch_adamw

        torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, **kwargs)
        return
    from torch.optim.adam import adam as torch_adam

    if _has_decoupled_flag():
        kwargs["decoupled_weight_decay"] = adamw_mode
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, **kwargs)


def _torch_hyper(hyper: AdamHyper) -> dict[str, float]:
    """Hyperparameters for torch's (always bias-corrected) Adam; see [Note: fallback bias correction]."""
    step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode = hyper
    if bias_correction:
        return dict(lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2)
    bc1 = 1.0 - beta1**step
    bc2s = math.sqrt(1.0 - beta2**step)
    if bc1 <= 0.0 or bc2s <= 0.0:
        raise ValueError(f"cpu_adam: betas ({beta1}, {beta2}) must be in [0, 1)")
    lr_t = lr * bc1 / bc2s
    # L2 decay (g += wd * p) does not involve lr; AdamW's does.
    wd_t = weight_decay * lr / lr_t if adamw_mode and lr_t != 0.0 else weight_decay
    return dict(lr=lr_t, eps=eps / bc2s, weight_decay=wd_t, beta1=beta1, beta2=beta2)


def _copy_out(out: Tensor | None, src: Tensor) -> None:
    if out is not None:
        out.view(-1).copy_(src.reshape(-1))


def _all_fp32(*tensors: Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def _batches(indices: list[int], params: list[Tensor]) -> list[list[int]]:
    batches: list[list[int]] = []
    size = 0
    for i in indices:
        if batches and size + params[i].numel() <= _SCRATCH_BATCH // 4:
            batches[-1].append(i)
            size += params[i].numel()
        else:
            batches.append([i])
            size = params[i].numel()
    return batches


_SCRATCH: list[Tensor] = []


def _scratch(numel: int) -> Tensor:
    """A module-wide fp32 buffer of at least `numel` elements, reused across steps."""
    if not _SCRATCH or _SCRATCH[0].numel() < numel:
        _SCRATCH[:] = [torch.empty(numel, dtype=torch.float32)]
    return _SCRATCH[0]


@functools.cache
def _fused_supported() -> bool:
    """Whether the installed torch has the fused Adam kernel on CPU (torch >= 2.4)."""
    from torch.optim.adam import adam as torch_adam

    t = [torch.zeros(1)]
    try:
        torch_adam(
            t,
            [torch.zeros(1)],
            [torch.zeros(1)],
            [torch.zeros(1)],
            [],
            [torch.tensor(0.0)],
            fused=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=0.0,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )
    except (RuntimeError, TypeError):
        return False
    return True


@functools.cache
def _has_decoupled_flag() -> bool:
    from torch.optim.adam import adam as torch_adam

    return "decoupled_weight_decay" in inspect.signature(torch_adam).parameters


def _check_lists(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    low_precision_out: list[Tensor],
) -> None:
    """The native module's argument checks, with the same exception types and messages."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(
            "cpu_adam.adam_update: params, grads, exp_avgs and exp_avg_sqs must have the same "
            f"length, got {n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}"
        )
    if low_precision_out and len(low_precision_out) != n:
        raise ValueError(
            "cpu_adam.adam_update: low_precision_out must be empty or have one tensor per param "
            f"({n}), got {len(low_precision_out)}"
        )
    named = (
        ("params", params),
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("low_precision_out", low_precision_out or []),
    )
    for name, tensors in named:
        for i, t in enumerate(tensors):
            _check_tensor(t, name, i)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if g.dtype != p.dtype:
            raise TypeError(
                f"cpu_adam.adam_update: grads[{i}] has dtype {g.dtype} but params[{i}] has dtype "
                f"{p.dtype}; grads must have the param dtype"
            )
        if not (g.numel() == m.numel() == v.numel() == p.numel()):
            raise ValueError(
                f"cpu_adam.adam_update: params[{i}] has {p.numel()} elements but its "
                f"grad/exp_avg/exp_avg_sq have {g.numel()}/{m.numel()}/{v.numel()}"
            )
        if low_precision_out:
            o = low_precision_out[i]
            if o.dtype not in _OUT_DTYPES:
                raise TypeError(
                    f"cpu_adam.adam_update: low_precision_out[{i}] has dtype {o.dtype}; it must be bfloat16 or float16"
                )
            if o.numel() != p.numel():
                raise ValueError(
                    f"cpu_adam.adam_update: low_precision_out[{i}] has {o.numel()} elements but "
                    f"params[{i}] has {p.numel()}"
                )


def _check_tensor(t: Tensor, name: str, i: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"cpu_adam.adam_update: {name}[{i}] is {type(t).__name__}, not a torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(
            f"cpu_adam.adam_update: {name}[{i}] is on {t.device}; every tensor must be on the CPU (move it with .cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(
            f"cpu_adam.adam_update: {name}[{i}] has layout {t.layout}; sparse tensors are not "
            "supported, densify the gradient first"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"cpu_adam.adam_update: {name}[{i}] is not contiguous; pass t.contiguous() (params "
            "must be updated in place)"
        )
