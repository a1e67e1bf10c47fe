"""DeepSpeed's functional cpu_adam interface on Slipstream's op (ops/adam/ds_op_api.py): the id-based
`adam_update` against torch's AdamW, and the ZenFlow optimizer process against the same updates in-process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from slipstream.ops.op_builder import CPUAdamBuilder

HYPER = (1e-2, 0.9, 0.99, 1e-8, 0.05)  # lr, beta1, beta2, eps, weight_decay


def test_id_based_update_is_adamw() -> None:
    op = CPUAdamBuilder().load()
    op.create_adam(7, *HYPER, True, False)
    param, ref = torch.randn(33), None
    ref = torch.nn.Parameter(param.clone())
    torch_opt = torch.optim.AdamW([ref], lr=HYPER[0], betas=HYPER[1:3], eps=HYPER[3], weight_decay=HYPER[4])
    m, v = torch.zeros(33), torch.zeros(33)
    for step in range(1, 6):
        grad = torch.randn(33)
        op.adam_update(7, step, *HYPER, True, param, grad, m, v)
        ref.grad = grad.clone()
        torch_opt.step()
    op.destroy_adam(7)
    torch.testing.assert_close(param, ref.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="call create_adam\\(7"):
        op.adam_update(7, 1, *HYPER, True, param, grad, m, v)


def _worker(tensors: list, ctrl: torch.Tensor, ready) -> None:  # type: ignore[no-untyped-def]
    op = CPUAdamBuilder().load()
    op.create_adam(0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    handle = op.zenflow_adam_create(0, [])
    for group in tensors:
        op.zenflow_adam_register_group(handle, *group)
    ready.set()
    op.zenflow_adam_run_worker(handle, ctrl.data_ptr())
    op.zenflow_adam_destroy(handle)


def test_zenflow_optimizer_process_matches_in_process_updates() -> None:
    op = CPUAdamBuilder().load()
    sizes = (17, 40)  # two groups with their own hyperparameters
    groups = [[torch.randn(n).share_memory_()] + [torch.zeros(n).share_memory_() for _ in range(7)] for n in sizes]
    ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
    op.zenflow_adam_ctrl_init(ctrl.data_ptr(), len(groups))
    op.create_adam(1, 0.0, 0.0, 0.0, 0.0, 0.0, True, False)
    mirror = [[t.clone() for t in group] for group in groups]
    context = mp.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_worker, args=(groups, ctrl, ready))
    process.start()
    try:
        assert ready.wait(timeout=120)
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 0.05) is False  # nothing submitted: a bounded wait
        hypers = [(1e-2, 0.9, 0.999, 1e-8, 0.0), (3e-3, 0.8, 0.99, 1e-6, 0.1)]
        for step in range(1, 5):
            now = step % 2
            for group, reference in zip(groups, mirror):
                grad = torch.randn(group[0].numel())
                group[1 + now].copy_(grad)
                reference[1 + now].copy_(grad)
            op.zenflow_adam_submit(ctrl.data_ptr(), now, step, *([h[i] for h in hypers] for i in range(5)), [1, 1])
            assert op.zenflow_adam_wait(ctrl.data_ptr(), 60.0)
            for (param, g0, g1, m0, m1, v0, v1, stale), hyper in zip(mirror, hypers):
                grad, m, v = (g0, m0, v0) if now == 0 else (g1, m1, v1)
                op.adam_update(1, step, *hyper, True, param, grad, m, v)
                stale.copy_(param)
            for group, reference in zip(groups, mirror):
                for got, expected in zip(group, reference):
                    assert torch.equal(got, expected), f"step {step}"
        assert op.zenflow_adam_wait(ctrl.data_ptr(), 0.05) is False  # one True per completed step
        op.zenflow_adam_ctrl_exit(ctrl.data_ptr())
        process.join(timeout=30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.terminate()
        op.destroy_adam(1)
