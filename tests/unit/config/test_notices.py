"""Config notices (slipstream/config/notices.py): what each names, where it goes (a warning on every rank, a log
record on rank 0, once per key per process), and the log line for an "auto" batch key."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import pytest

from slipstream.config import resolve
from slipstream.config.notices import instead_of, notice, report_auto_batch, report_unimplemented


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    logger, handler = logging.getLogger("slipstream"), Keep(level=logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield kept
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize(
    "key, instead",
    [
        ("memory_breakdown", "as with its default, false"),
        ("gradient_predivide_factor", "as with its default, 1.0"),
        ("zero_optimization.stage3_prefetch_bucket_size", "as with its default, 50000000"),  # an alias
        ("sparse_attention", "as if it were not set"),
        ("optimizer.type=muadam", "the optimizer passed to initialize() is used instead"),
        ("amp.some_extra_key", "the run ignores it"),
    ],
)
def test_each_notice_says_what_the_run_does_instead(key: str, instead: str) -> None:
    assert instead in instead_of(key)


def test_a_notice_reaches_the_log_with_warnings_ignored_once_per_key(records: list[logging.LogRecord]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        report_unimplemented(["memory_breakdown", "memory_breakdown"], rank=0)
        report_unimplemented(["memory_breakdown"], rank=0)
    logged = [r for r in records if "memory_breakdown" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "accepted but not implemented" in logged[0].getMessage() and "default, false" in logged[0].getMessage()


def test_a_notice_warns_on_every_rank_and_logs_on_rank_0_only(records: list[logging.LogRecord]) -> None:
    with pytest.warns(UserWarning, match="on rank 1"):
        notice("k1", "on rank 1", rank=1)
    assert not [r for r in records if "on rank 1" in r.getMessage()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning turned into an error does not swallow the log record
        with pytest.raises(UserWarning):
            notice("k0", "on rank 0", rank=0)
    assert [r.getMessage() for r in records if "on rank 0" in r.getMessage()] == ["on rank 0"]


def test_an_auto_micro_batch_is_logged_with_its_value_and_sources(records: list[logging.LogRecord]) -> None:
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": "auto"}
    report_auto_batch(resolve(config, world_size=2).batch, rank=0)
    assert [r.getMessage() for r in records] == [
        'config: train_micro_batch_size_per_gpu "auto" resolved to 4 (16 / (2 * 2)) from train_batch_size 16 and '
        "gradient_accumulation_steps 2 and 2 data-parallel rank(s)"
    ]
    report_auto_batch(resolve({"train_batch_size": 16}, world_size=2).batch, rank=0)  # no "auto": nothing
    report_auto_batch(resolve(config, world_size=2).batch, rank=1)  # not rank 0: nothing
    assert len(records) == 1


@pytest.mark.parametrize("stage, reported", [(2, False), (3, True)])
def test_reduce_bucket_size_is_reported_at_stage_3_only(stage: int, reported: bool) -> None:
    """Stage 3 reduce-scatters per unit whatever the bucket size: the key set there is not a silent no-op."""
    zero = {"stage": stage, "reduce_bucket_size": 1000}
    plan = resolve({"train_batch_size": 2, "zero_optimization": zero}, world_size=1)
    unset = resolve({"train_batch_size": 2, "zero_optimization": {"stage": stage}}, world_size=1)
    assert ("zero_optimization.reduce_bucket_size" in plan.unimplemented) is reported
    assert unset.unimplemented == ()
    assert "stage 3" in instead_of("zero_optimization.reduce_bucket_size")
