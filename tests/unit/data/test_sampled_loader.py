"""The engine's curriculum loader: `initialize(training_data=...)` and `deepspeed_io` build it from the
data_efficiency section, its batches follow the schedule, the post-process hook sees the difficulty, and a
checkpoint carries the sampler so a resumed engine reads the same batches."""

from __future__ import annotations

from pathlib import Path

import torch

import slipstream
from slipstream.data.indexed_dataset import write_rows
from slipstream.data.sampled_loader import CurriculumDataLoader

ROWS = {1: [1, 3], 2: [6, 16], 3: [0, 9, 15, 17], 4: [2, 19], 5: [4, 8, 10], 6: [7], 7: [13], 8: [11, 18],
        9: [5, 12, 14]}  # value -> samples (tests/unit/data/test_curriculum_sampler.py's index)
AT_MOST_2 = {1, 3, 6, 16}


def _config(index: Path) -> dict:
    metric = {"index_to_sample_path": str(index / "m_index_to_sample"),
              "index_to_metric_path": str(index / "m_index_to_metric"), "difficulty_type": "value",
              "clustering_type": "schedule_based", "min_difficulty": 2, "max_difficulty": 9,
              "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [2, 4, 9], "max_step": [2, 4]}}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
            "data_efficiency": {"enabled": True, "seed": 5, "data_sampling": {"enabled": True, "curriculum_learning": {
                "enabled": True, "data_cluster_path": str(index / "clusters"), "curriculum_metrics": {"m": metric}}}}}


def _engine(index: Path) -> slipstream.SlipstreamEngine:
    data = torch.utils.data.TensorDataset(torch.arange(20, dtype=torch.float32).unsqueeze(1))
    engine, _, loader, _ = slipstream.initialize(model=torch.nn.Linear(1, 1), config=_config(index),
                                                 training_data=data)
    assert loader is engine.training_dataloader
    return engine


def _steps(engine: slipstream.SlipstreamEngine, stream: object, count: int) -> list[list[int]]:
    seen = []
    for _ in range(count * engine.gradient_accumulation_steps()):
        batch = next(stream)  # type: ignore[call-overload]
        inputs = batch[0] if isinstance(batch, tuple) else batch
        inputs = inputs[0] if isinstance(inputs, list) else inputs
        engine.backward(engine(inputs).sum())
        engine.step()
        seen.append([int(v) for v in inputs[:, 0]])
    return seen


def test_engine_loader_follows_the_curriculum_and_resumes(tmp_path: Path) -> None:
    write_rows(str(tmp_path / "m_index_to_sample"), list(ROWS.values()), "uint8")
    write_rows(str(tmp_path / "m_index_to_metric"), [[value] for value in ROWS], "uint8")
    engine = _engine(tmp_path)
    loader = engine.training_dataloader
    assert isinstance(loader, CurriculumDataLoader) and len(loader) == 20 * 1000 // 2
    assert isinstance(engine.deepspeed_io(loader.dataset), CurriculumDataLoader)
    engine.set_data_post_process_func(lambda batch, state: (batch, state["current_difficulties"]["m"]))
    stream = iter(loader)
    difficulties = []
    first = []
    for _ in range(4):  # steps 1-2: two micro-batches each, from the 4 samples of value <= 2
        batch, difficulty = next(stream)
        difficulties.append(difficulty)
        first.append([int(v) for v in batch[0][:, 0]])
    assert difficulties == [2, 2, 2, 2] and set(sum(first, [])) == AT_MOST_2
    engine.set_data_post_process_func(None)
    _steps(engine, stream, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    after = _steps(engine, stream, 3)
    resumed = _engine(tmp_path)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert _steps(resumed, iter(resumed.training_dataloader), 3) == after
    schedule = {"m": lambda step: 9}
    resumed.set_custom_curriculum_learning_schedule(schedule)  # DeepSpeed's hook reaches the sampler
    assert resumed.training_dataloader.data_sampler.custom_schedules == schedule
