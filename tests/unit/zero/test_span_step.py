"""`bucket_spans` (zero/span_step.py): consecutive buckets, in order, covering every bucket once, each span at
least the span size but the last; and which optimizers the span step takes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.ops.adam import FusedAdam
from slipstream.zero.layout import build_layout
from slipstream.zero.span_step import SpanStep, bucket_spans


def test_spans_cover_the_buckets_in_order_each_at_least_the_span_size() -> None:
    layout = build_layout([300, 50, 50, 700, 10, 10, 10, 400], world_size=2, bucket_numel=100)
    sizes = [bucket.padded_numel for bucket in layout.buckets]
    for span_numel in (1, 150, 500, 10**9):
        spans = bucket_spans(layout, span_numel)
        assert [first for first, _ in spans] == [0] + [end for _, end in spans[:-1]], (span_numel, spans)
        assert spans[-1][1] == len(sizes)
        assert all(sum(sizes[a:b]) >= span_numel for a, b in spans[:-1]), (span_numel, spans)
        assert all(sum(sizes[a : b - 1]) < span_numel for a, b in spans), (span_numel, spans)  # none longer than needed
    assert bucket_spans(layout, 1) == [(i, i + 1) for i in range(len(sizes))]
    assert bucket_spans(layout, 10**9) == [(0, len(sizes))]


def test_the_span_step_takes_only_optimizers_it_can_cut_and_no_offload_or_stochastic_rounding() -> None:
    from slipstream.offload.policy import CPUOffload, OffloadPolicy
    from slipstream.precision.masters import NearestRounding, StochasticRounding
    from slipstream.zero.comm_stream import CommStream

    params = [torch.nn.Parameter(torch.zeros(4))]

    class CountsPerGroup(torch.optim.AdamW):  # a subclass may keep its step count per param group
        pass

    def built(optimizer: torch.optim.Optimizer, **changes: object) -> bool:
        parts = {
            "optimizer": optimizer,
            "master_rounding": NearestRounding(),
            "offload": OffloadPolicy(),
            "groups": [],
            "_low_precision_out": [],
            **changes,
        }
        return SpanStep.for_optimizer(SimpleNamespace(**parts), comm=CommStream(enabled=False)) is not None  # type: ignore[arg-type]

    assert built(torch.optim.AdamW(params)) and built(FusedAdam(params)) and built(torch.optim.SGD(params, lr=0.1))
    assert not built(CountsPerGroup(params))
    assert not built(torch.optim.Adagrad(params))  # elementwise, but not one of the optimizers the span step knows
    if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
        assert not built(torch.optim.Adafactor(params))  # factored moments: per tensor
    assert not built(torch.optim.AdamW(params), master_rounding=StochasticRounding())
    assert not built(torch.optim.AdamW(params), offload=CPUOffload(pin_memory=False))
    assert not built(torch.optim.AdamW(params), _low_precision_out=[torch.zeros(4)])
    hooked = torch.optim.AdamW(params)
    handle = hooked.register_step_post_hook(lambda *_: None)  # it would run once per span
    assert not built(hooked)
    handle.remove()
    assert built(hooked)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *_: None)  # every optimizer's
    try:
        assert not built(torch.optim.AdamW(params))
    finally:
        handle.remove()
