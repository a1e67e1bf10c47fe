"""Layer reduction: init_compression starts a student with fewer layers from the teacher's chosen layers (and its
other named modules), so the student computes exactly the teacher's forward through those layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.compression import init_compression


class _Stack(nn.Module):
    def __init__(self, layers: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(3, 8)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, only: list[int] | None = None) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.encoder.layer):
            if only is None or i in only:
                h = layer(h)
        return self.head(h)


def _config(**section: object) -> dict[str, object]:
    reduction = {
        "enabled": True,
        "keep_number_layer": 2,
        "module_name_prefix": "encoder.layer",
        "teacher_layer": [1, 3],
        "other_module_name": ["embed", "head"],
        **section,
    }
    return {"train_batch_size": 1, "compression_training": {"layer_reduction": reduction}}


def test_student_starts_as_the_teachers_chosen_layers() -> None:
    teacher, student = _Stack(4, seed=0), _Stack(2, seed=1)
    init_compression(student, _config(), teacher_model=teacher)
    for s_index, t_index in ((0, 1), (1, 3)):
        for s_param, t_param in zip(
            student.encoder.layer[s_index].parameters(), teacher.encoder.layer[t_index].parameters()
        ):
            assert torch.equal(s_param, t_param)
    x = torch.randn(5, 3)
    torch.testing.assert_close(student(x), teacher(x, only=[1, 3]), rtol=0, atol=0)


def test_without_other_modules_the_students_own_stay() -> None:
    teacher, student = _Stack(4, seed=0), _Stack(2, seed=1)
    head = student.head.weight.detach().clone()
    init_compression(student, _config(other_module_name=[]), teacher_model=teacher)
    assert torch.equal(student.head.weight, head) and torch.equal(
        student.encoder.layer[1][0].bias, teacher.encoder.layer[3][0].bias
    )


def test_layer_reduction_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="got no teacher_model"):
        init_compression(_Stack(2, seed=1), _config())
    with pytest.raises(ValueError, match="keep_number_layer 3, teacher_layer \\[1, 3\\]"):
        init_compression(_Stack(2, seed=1), _config(keep_number_layer=3), teacher_model=_Stack(4, seed=0))
    with pytest.raises(ValueError, match="teacher model has no module 'encoder.layer.7'"):
        init_compression(_Stack(2, seed=1), _config(teacher_layer=[1, 7]), teacher_model=_Stack(4, seed=0))
    wide = _Stack(4, seed=0)
    wide.head = nn.Linear(8, 5)
    with pytest.raises(ValueError, match="student head.bias \\(2,\\) and teacher head.bias \\(5,\\)"):
        init_compression(_Stack(2, seed=1), _config(), teacher_model=wide)
