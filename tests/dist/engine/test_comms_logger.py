"""The comms logger on 2 gloo ranks: its counts are the collectives layer's, with time, per kind."""

from __future__ import annotations

import logging

from tests.harness import run_distributed
from tests.harness.models import TinyMLP


def comms_logger_run(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.comm import count_collectives

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("slipstream")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 700},
        "steps_per_print": 2,
        "comms_logger": {"enabled": True, "verbose": True, "debug": True, "prof_all": True},
    }
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    with count_collectives() as independent:
        x, y = TinyMLP().make_batch(seed=rank, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()  # step 1: no summary yet
    logged = engine._comms_log.counter
    result = {
        "same_calls": dict(logged.calls) == dict(independent.calls),
        "same_bytes": dict(logged.bytes) == dict(independent.bytes),
        "kinds": sorted(logged.calls),
        "timed": all(logged.seconds[k] > 0 for k in logged.calls),
    }
    x, y = TinyMLP().make_batch(seed=10 + rank, batch_size=4)
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()  # step 2: the summary, then the counts start again
    result["after_summary"] = sum(logged.calls.values())
    result["summaries"] = [line for line in lines if line.startswith("comms summary")]
    result["verbose"] = [line for line in lines if line.startswith("comm: ")]
    engine.destroy()
    return result


def test_comms_logger_counts_what_the_collectives_layer_counts() -> None:
    results = run_distributed(comms_logger_run, world_size=2, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["same_calls"] and result["same_bytes"], result
        assert "all_reduce" in result["kinds"], result  # at least the step's loss average
        assert result["timed"] and result["after_summary"] == 0
        if rank == 0:
            (summary,) = result["summaries"]
            assert all(kind in summary for kind in result["kinds"]) and " calls " in summary and "ms mean" in summary
            assert result["verbose"] and all(" from slipstream/" in line for line in result["verbose"])
        else:  # rank 0 prints; every rank counts
            assert result["summaries"] == [] and result["verbose"] == []
