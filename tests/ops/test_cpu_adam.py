"""cpu_adam op (native and fallback) and DeepSpeedCPUAdam: numerics vs torch.optim.Adam/AdamW, errors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

import slipstream.ops.fallback.cpu_adam as fallback_op
from slipstream.ops.adam import DeepSpeedCPUAdam

LENGTHS = (1, 7, 15, 17, 1023, 100003)
STEPS = 100
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def native_op() -> ModuleType:
    from slipstream.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder().jit_load()


@pytest.fixture(params=["native", "fallback"])
def op(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "fallback":
        return fallback_op
    request.applymarker(pytest.mark.needs_compiler)
    return request.getfixturevalue("native_op")


def _make_opt(params: list, op: ModuleType, **kwargs) -> DeepSpeedCPUAdam:
    opt = DeepSpeedCPUAdam(params, **kwargs)
    opt._op = op  # pin the implementation under test (the builder would pick one per process)
    return opt


def _run_op(op: ModuleType, params: list[torch.Tensor], grads_fn: Callable[[int], list[torch.Tensor]], *,
            steps: int, weight_decay: float, bias_correction: bool, adamw_mode: bool,
            outs: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ms = [torch.zeros(p.numel()) for p in params]
    vs = [torch.zeros(p.numel()) for p in params]
    for s in range(1, steps + 1):
        op.adam_update(params, grads_fn(s), ms, vs, s, HYPER["lr"], HYPER["beta1"], HYPER["beta2"],
                       HYPER["eps"], weight_decay, bias_correction, adamw_mode, outs or [])
    return ms, vs


def _grads(lengths: tuple[int, ...],
           dtype: torch.dtype = torch.float32) -> Callable[[int], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    cache: dict[int, list[torch.Tensor]] = {}

    def grads(step: int) -> list[torch.Tensor]:
        if step not in cache:
            cache[step] = [torch.randn(n, generator=gen).to(dtype) for n in lengths]
        return cache[step]
    return grads


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adam(op: ModuleType, adamw_mode: bool, weight_decay: float) -> None:
    init = [torch.randn(n) for n in LENGTHS]
    grads = _grads(LENGTHS)
    ref = [p.clone().requires_grad_() for p in init]
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = torch_cls(ref, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                        weight_decay=weight_decay, foreach=False)
    for s in range(1, STEPS + 1):
        for p, g in zip(ref, grads(s)):
            p.grad = g.clone()
        ref_opt.step()
    ours = [p.clone() for p in init]
    _run_op(op, ours, grads, steps=STEPS, weight_decay=weight_decay, bias_correction=True,
            adamw_mode=adamw_mode)
    for n, a, b in zip(LENGTHS, ours, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"length {n}: {m}")


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_no_bias_correction_matches_manual(op: ModuleType, adamw_mode: bool) -> None:
    wd, b1, b2, lr, eps = 0.05, HYPER["beta1"], HYPER["beta2"], HYPER["lr"], HYPER["eps"]
    init = [torch.randn(n) for n in LENGTHS]
    grads = _grads(LENGTHS)
    ref = [p.clone() for p in init]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for s in range(1, STEPS + 1):
        for p, g, mi, vi in zip(ref, grads(s), m, v):
            g = g if adamw_mode else g + wd * p
            if adamw_mode:
                p.mul_(1 - lr * wd)
            mi.mul_(b1).add_(g, alpha=1 - b1)
            vi.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(mi, vi.sqrt().add_(eps), value=-lr)
    ours = [p.clone() for p in init]
    _run_op(op, ours, grads, steps=STEPS, weight_decay=wd, bias_correction=False, adamw_mode=adamw_mode)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.needs_compiler
def test_native_thread_count_does_not_change_results(native_op: ModuleType) -> None:
    init = [torch.randn(n) for n in (3, 70001, 200003)]
    grads = _grads((3, 70001, 200003))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ps = [p.clone() for p in init]
            _run_op(native_op, ps, grads, steps=5, weight_decay=0.01, bias_correction=True, adamw_mode=True)
            results.append(ps)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_bf16_params_fp32_states(op: ModuleType, adamw_mode: bool) -> None:
    lengths, wd = (7, 17, 1023, 100003), 0.01
    grads = _grads(lengths, torch.bfloat16)
    params = [torch.randn(n).bfloat16() for n in lengths]
    ref = [p.clone() for p in params]
    # the reference is torch's optimizer (not the fallback op, which is one of the ops under test): fp32 math
    # from the bf16 values, rounded to bf16 after every step
    p32 = [p.float().requires_grad_() for p in ref]
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = torch_cls(p32, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                        weight_decay=wd, foreach=False)
    steps = 20
    for s in range(1, steps + 1):
        for p, q, g in zip(ref, p32, grads(s)):
            q.data.copy_(p)
            q.grad = g.float()
        ref_opt.step()
        for p, q in zip(ref, p32):
            p.copy_(q.detach())
    ref_m = [ref_opt.state[q]["exp_avg"] for q in p32]
    ref_v = [ref_opt.state[q]["exp_avg_sq"] for q in p32]
    ms, vs = _run_op(op, params, grads, steps=steps, weight_decay=wd, bias_correction=True,
                     adamw_mode=adamw_mode)
    for p, r, m, rm, v, rv in zip(params, ref, ms, ref_m, vs, ref_v):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert (p == r).float().mean() > 0.99  # fp32 rounding differences may flip a bf16 rounding rarely
        torch.testing.assert_close(p.float(), r.float(), rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(m, rm, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_out_is_the_cast_update(op: ModuleType, param_dtype: torch.dtype,
                                              out_dtype: torch.dtype) -> None:
    lengths = (1, 17, 1023, 100003)
    params = [torch.randn(n).to(param_dtype) for n in lengths]
    outs = [torch.full((n,), 7.0, dtype=out_dtype) for n in lengths]
    _run_op(op, params, _grads(lengths, param_dtype), steps=3, weight_decay=0.0, bias_correction=True,
            adamw_mode=True, outs=outs)
    for p, o in zip(params, outs):
        if param_dtype == torch.float32 or out_dtype == torch.bfloat16:
            assert torch.equal(o, p.to(out_dtype))
        else:  # rounded from the fp32 value, not from the bf16 param
            torch.testing.assert_close(o.float(), p.float(), rtol=2 ** -7, atol=1e-3)


def _model_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in ((33, 5), (5,), (1000,))]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(op: ModuleType, dtype: torch.dtype) -> None:
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    params = _model_params(dtype)
    opt = _make_opt([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], op, **kwargs)
    _train(opt, params, range(5))
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    _train(opt, params, range(5, 10))

    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = _make_opt([{"params": resumed[:2]}, {"params": resumed[2:], "lr": 3e-3}], op, **kwargs)
    opt2.load_state_dict(saved)
    state = opt2.state[resumed[2]]
    assert state["step"].dtype == torch.float32 and state["step"].item() == 5.0
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    _train(opt2, resumed, range(5, 10))
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_state_dict_layout_matches_torch(op: ModuleType) -> None:
    params = _model_params(torch.float32)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = _make_opt(params, op), torch.optim.AdamW(ref, weight_decay=0)
    _train(opt, params, range(2))
    _train(ref_opt, ref, range(2))
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].keys() == theirs[k].keys()
        ours_step, their_step = ours[k]["step"], theirs[k]["step"]
        assert ours_step.dtype == their_step.dtype and ours_step.shape == their_step.shape
    opt.load_state_dict(ref_opt.state_dict())  # torch's state loads into ours


def test_param_groups_lr_schedule_and_skipped_params(op: ModuleType) -> None:
    params = _model_params(torch.float32)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    def groups(ps: list[torch.nn.Parameter]) -> list[dict]:
        return [{"params": ps[:1], "weight_decay": 0.2}, {"params": ps[1:], "lr": 1e-3}]

    opt = _make_opt(groups(params), op, lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.0)
    frozen = params[1].detach().clone()
    for s in range(6):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 1e-2 / (s + 1)
        for ps in (params, ref):
            for i, p in enumerate(ps):
                p.grad = None if i == 1 else torch.full(p.shape, 0.5 - s / 10)
        opt.step()
        ref_opt.step()
    assert torch.equal(params[1], frozen) and params[1] not in opt.state
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_optimizer_low_precision_out_and_low_precision_states(op: ModuleType) -> None:
    params = _model_params(torch.bfloat16)
    outs = [torch.empty(p.shape, dtype=torch.float16) for p in params]
    opt = _make_opt(params, op, fp32_optimizer_states=False)
    _train(opt, params, range(3))
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    params32 = _model_params(torch.float32)
    opt32 = _make_opt(params32, op)
    for s in range(3):
        for p in params32:
            p.grad = torch.randn(p.shape)
        opt32.step(low_precision_out=outs)
    for p, o in zip(params32, outs):
        assert torch.equal(o, p.detach().half())
    with pytest.raises(ValueError, match="low_precision_out has 1 tensors"):
        opt32.step(low_precision_out=outs[:1])


def test_fallback_selected_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import slipstream.ops.op_builder.builder as builder

    monkeypatch.setenv("SLIPSTREAM_OPS", "fallback")
    monkeypatch.setattr(builder, "_LOADED", {})
    opt = DeepSpeedCPUAdam(_model_params(torch.float32))
    assert opt._op.simd_level() == "fallback"


def test_user_errors(op: ModuleType) -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam(_model_params(torch.float32), amsgrad=True)
    with pytest.raises(ValueError, match="param 1 is on meta"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2)),
                          torch.nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(TypeError, match="param 0 has dtype torch.float64"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="param 0 has a sparse gradient"):
        _make_opt(emb.parameters(), op).step()


def test_op_argument_errors(op: ModuleType) -> None:
    p, g, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)

    def call(params=None, grads=None, ms=None, outs=None, step=1):  # noqa: ANN001, ANN202
        op.adam_update(params or [p, p.clone()], grads or [g, g], ms or [m, m.clone()], [v, v.clone()], step,
                       1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, outs or [])

    with pytest.raises(TypeError, match=r"grads\[1\] has dtype torch.bfloat16"):
        call(grads=[g, g.bfloat16()])
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float64"):
        call(params=[p.double(), p], grads=[g.double(), g])
    with pytest.raises(TypeError, match=r"exp_avgs\[1\]"):
        call(ms=[m, m.bfloat16()])
    with pytest.raises(ValueError, match=r"params\[1\] has 4 elements"):
        call(grads=[g, torch.zeros(5)])
    with pytest.raises(TypeError, match=r"low_precision_out\[0\] has dtype torch.float32"):
        call(outs=[torch.zeros(4), torch.zeros(4).half()])
    with pytest.raises(ValueError, match=r"params\[1\] is on meta"):
        call(params=[p, torch.zeros(4, device="meta")])
    with pytest.raises(ValueError, match=r"not contiguous"):
        call(params=[p, torch.zeros(2, 4).t()[0]])
    with pytest.raises(ValueError, match="step must be"):
        call(step=0)
