"""`DeepSpeedCPUAdam`: torch.optim.Optimizer face of the `cpu_adam` op (DeepSpeed's constructor and state).

Owns the per-parameter state (`step` as a float32 scalar tensor like torch.optim.Adam, `exp_avg`,
`exp_avg_sq`), the grouping of a step into one op call per (param group, step count), and the argument checks
that name the parameter by its index over all groups. The math lives in the op:
slipstream/ops/csrc/adam/cpu_adam.cpp, or its pure-PyTorch fallback slipstream/ops/fallback/cpu_adam.py.

Routing: fp32/bf16 params with fp32 states go to the loaded op (native when it builds). States in a low
precision (fp32_optimizer_states=False with a bf16/fp16 param) and fp16 params go to the fallback's
`adam_update_any_dtype` (fp32 math, rounded on store), which the native kernel does not cover.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import Tensor

_NATIVE_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for parameters in CPU memory, with an optional low-precision copy written in the same pass.

    Args mirror deepspeed.ops.adam.DeepSpeedCPUAdam. `adamw_mode=True` is decoupled weight decay (AdamW),
    False is L2 (torch.optim.Adam). `fp32_optimizer_states=False` keeps states in the param dtype.
    """

    writes_low_precision_copy: ClassVar[bool] = True
    """`step(low_precision_out=...)` writes the new values in the parameter dtype in the same pass (the ZeRO
    optimizer asks for this capability, not for the class)."""

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdam does not support amsgrad=True (DeepSpeed's does not either); "
                "pass amsgrad=False, or use torch.optim.Adam(params, amsgrad=True) for AMSGrad"
            )
        _check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, amsgrad=False
        )
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        for index, p in enumerate(self._all_params()):
            _check_param(p, index, building=True)
        self._op = _load_op()

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        dtype = self._state_dtype(p)
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros(p.shape, dtype=dtype),
            "exp_avg_sq": torch.zeros(p.shape, dtype=dtype),
        }

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        low_precision_out: Sequence[Tensor] | None = None,
    ) -> float | None:
        """One Adam step over every param with a grad; params with grad None are skipped.

        low_precision_out: None, or one bf16/fp16 CPU tensor per param of all groups in order (same numel),
        each receiving the updated param values cast in the same pass (entries of skipped params stay as
        they are).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._all_params()
        outs = _check_low_precision_out(low_precision_out, params)
        index = 0
        for group in self.param_groups:
            # (step count, native?) -> [params, grads, exp_avgs, exp_avg_sqs, outs]
            calls: dict[tuple[int, bool], list[list[Tensor]]] = {}
            for p in group["params"]:
                out = outs[index] if outs else None
                grad = _checked_grad(p, index)
                index += 1
                if grad is None:
                    continue
                state = self.state[p]
                step, native = self._advance(state, p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                lists = calls.setdefault((step, native), [[], [], [], [], []])
                for dst, t in zip(lists, (p, grad, m, v, out)):
                    if t is not None:
                        dst.append(t)
            for (step, native), (ps, gs, ms, vs, os_) in calls.items():
                self._update(group, ps, gs, ms, vs, os_, step=step, native=native)
        return loss

    def _advance(self, state: dict[str, Any], p: Tensor) -> tuple[int, bool]:
        """Count one more step in `state` (created on first use); (the 1-based step, native kernel usable?)."""
        if not state:
            state.update(self._init_state(p))
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        return int(state["step"].item()), p.dtype in _NATIVE_PARAM_DTYPES and m.dtype == torch.float32 == v.dtype

    def _update(
        self,
        group: dict[str, Any],
        ps: list[Tensor],
        gs: list[Tensor],
        ms: list[Tensor],
        vs: list[Tensor],
        outs: list[Tensor],
        *,
        step: int,
        native: bool,
    ) -> None:
        from slipstream.ops.fallback.cpu_adam import AdamHyper, adam_update_any_dtype

        beta1, beta2 = group["betas"]
        hyper = AdamHyper(
            step=step,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            bias_correction=bool(group["bias_correction"]),
            adamw_mode=self.adamw_mode,
        )
        if native:
            self._op.adam_update(ps, gs, ms, vs, *hyper, outs)
        else:
            adam_update_any_dtype(ps, gs, ms, vs, hyper, outs)

    # ---- DeepSpeed's sub-group entry points (SuperOffload: one optimizer step per sub-group, undone on overflow) ----
    def _subgroup_param(self, what: str) -> tuple[dict[str, Any], Tensor, Tensor]:
        """The one parameter with a gradient (a sub-group's flat buffer) and its group."""
        found = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(found) != 1:
            raise ValueError(
                f"DeepSpeedCPUAdam.{what}: a sub-group is one flat parameter with a gradient; this optimizer has "
                f"{len(found)} parameters with gradients. Use one optimizer per sub-group, or step() for all"
            )
        group, p = found[0]
        grad = _checked_grad(p, 0)
        if grad is None:  # not reached: p.grad was checked above
            raise RuntimeError(f"DeepSpeedCPUAdam.{what}: the parameter's gradient disappeared")
        return group, p, grad

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Callable[[], float] | None = None) -> float | None:
        """One Adam step of this optimizer's parameter, with its state kept under the key `subgroup_id`
        (DeepSpeed's SuperOffload keeps one state per sub-group this way)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group, p, grad = self._subgroup_param("step_subgroup")
        states: dict[Any, Any] = self.state  # keyed by sub-group number here, as DeepSpeed keys it
        state = states[subgroup_id]
        step, native = self._advance(state, p)
        self._update(group, [p], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], step=step, native=native)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Callable[[], float] | None = None) -> float | None:
        """Undo the last `step_subgroup(sub_group_id)` with the same gradient: the parameter and both moments
        return to their values before it (up to rounding: exactly in fp32 math, then stored in their dtypes)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        states: dict[Any, Any] = self.state
        state = states.get(sub_group_id)
        if not state:
            raise RuntimeError(
                f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been initialized "
                "(no step_subgroup for it yet)"
            )
        step = int(state["step"])
        if step <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {step}")
        group, p, grad = self._subgroup_param("rollback_subgroup")
        _adam_rollback(group, p, grad, state["exp_avg"], state["exp_avg_sq"], step=step, adamw_mode=self.adamw_mode)
        state["step"] -= 1
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, except that states keep their dtype (fp32) instead of the param dtype."""
        saved_state: dict[Any, dict[str, Any]] = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        by_id = dict(zip(saved_ids, self._all_params()))
        for pid, saved in saved_state.items():
            p = by_id.get(pid)
            if p is None:
                continue
            restored: dict[str, Any] = dict(saved)
            restored["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                restored[key] = saved[key].detach().to(device="cpu", dtype=self._state_dtype(p), copy=True).contiguous()
            self.state[p] = restored


def _adam_rollback(
    group: dict[str, Any], p: Tensor, grad: Tensor, m: Tensor, v: Tensor, *, step: int, adamw_mode: bool
) -> None:
    """The inverse of one Adam/AdamW update at 1-based `step` with gradient `grad` (fp32 math):
    p_new = p_old * (1 - lr * wd) - u (AdamW) or p_old - u with g += wd * p_old (L2), u = lr / bc1 * m / (sqrt(v) /
    bc2s + eps) on the new moments, m_new = b1 * m + (1 - b1) * g, v_new = b2 * v + (1 - b2) * g^2."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    bc1, bc2s = (1 - beta1**step, math.sqrt(1 - beta2**step)) if group["bias_correction"] else (1.0, 1.0)
    m32, v32, p32, g32 = m.float(), v.float(), p.float(), grad.float()
    undone = p32 + (lr / bc1) * m32 / (v32.sqrt() / bc2s + eps)
    if adamw_mode:
        p_old = undone / (1 - lr * decay) if decay else undone
    else:
        p_old = undone
        g32 = g32 + decay * p_old
    m.copy_((m32 - (1 - beta1) * g32) / beta1)
    v.copy_(((v32 - (1 - beta2) * g32 * g32) / beta2).clamp_(min=0))
    p.copy_(p_old)


def _load_op() -> ModuleType:
    """The cpu_adam op module: prebuilt, JIT-built, or the PyTorch fallback (see slipstream/ops/op_builder)."""
    from slipstream.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder().load()


def _check_hyper(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"DeepSpeedCPUAdam: invalid lr={lr}; it must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"DeepSpeedCPUAdam: invalid eps={eps}; it must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"DeepSpeedCPUAdam: invalid betas={betas}; both must be in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"DeepSpeedCPUAdam: invalid weight_decay={weight_decay}; it must be >= 0")


def _check_param(p: Tensor, index: int, *, building: bool = False) -> None:
    """`building`: the optimizer is being built. Parameters on an accelerator are allowed then: under ZeRO-Offload the
    engine builds this optimizer from the model's parameters and re-points it at host copies before the first step,
    as DeepSpeed's engine does; a parameter still on the accelerator at the step is an error."""
    if p.device.type != "cpu" and (not building or p.device.type == "meta"):
        raise ValueError(
            f"DeepSpeedCPUAdam: param {index} is on {p.device}, but every param must be on the "
            'CPU; keep the model on CPU, or enable ZeRO-Offload ("offload_optimizer": '
            '{"device": "cpu"}) so that the optimizer sees CPU copies'
        )
    if p.dtype not in _PARAM_DTYPES:
        raise TypeError(
            f"DeepSpeedCPUAdam: param {index} has dtype {p.dtype}; supported are float32, bfloat16 and float16"
        )
    if not p.is_contiguous():
        raise ValueError(
            f"DeepSpeedCPUAdam: param {index} (shape {tuple(p.shape)}) is not contiguous and "
            "cannot be updated in place; make it contiguous before building the optimizer"
        )


def _checked_grad(p: Tensor, index: int) -> Tensor | None:
    """The grad of param `index` ready for the op (contiguous), None when it has none; raises on bad grads."""
    grad = p.grad
    if grad is None:
        return None
    _check_param(p, index)
    if grad.is_sparse:
        raise RuntimeError(
            f"DeepSpeedCPUAdam: param {index} has a sparse gradient, which is not supported; "
            "use dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    if grad.device.type != "cpu":
        raise ValueError(f"DeepSpeedCPUAdam: the grad of param {index} is on {grad.device}; it must be on the CPU")
    if grad.dtype != p.dtype or grad.shape != p.shape:
        raise TypeError(
            f"DeepSpeedCPUAdam: the grad of param {index} has dtype {grad.dtype} and shape "
            f"{tuple(grad.shape)}, the param {p.dtype} and {tuple(p.shape)}; they must match"
        )
    return grad if grad.is_contiguous() else grad.contiguous()


def _check_low_precision_out(outs: Sequence[Tensor] | None, params: list[Tensor]) -> list[Tensor]:
    if outs is None:
        return []
    outs = list(outs)
    if len(outs) != len(params):
        raise ValueError(
            f"DeepSpeedCPUAdam.step: low_precision_out has {len(outs)} tensors but the "
            f"optimizer has {len(params)} params (all groups, in order); pass one tensor per "
            "param"
        )
    for index, (out, p) in enumerate(zip(outs, params)):
        if out.dtype not in _OUT_DTYPES:
            raise TypeError(
                f"DeepSpeedCPUAdam.step: low_precision_out[{index}] has dtype {out.dtype}; it "
                "must be torch.bfloat16 or torch.float16"
            )
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"DeepSpeedCPUAdam.step: low_precision_out[{index}] must be a contiguous CPU "
                f"tensor (got device {out.device}, contiguous={out.is_contiguous()}); copy it "
                "to the device after the step"
            )
        if out.numel() != p.numel():
            raise ValueError(
                f"DeepSpeedCPUAdam.step: low_precision_out[{index}] has {out.numel()} elements "
                f"but param {index} has {p.numel()}"
            )
    return outs
