"""Layer reduction (DeepSpeed's `student_initialization`): a student with fewer layers starts from chosen layers
of a teacher. Student layer i (`<module_name_prefix>.<i>`) takes the parameters of teacher layer
`teacher_layer[i]`; each module in `other_module_name` (embeddings, heads) takes the teacher's module's. The copy
goes by parameter name, and a name or shape the two sides do not share is an error naming it."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.compression.plan import LayerReductionPlan

__all__ = ["initialize_student"]


def _module(model: nn.Module, name: str, side: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"compression_training.layer_reduction: the {side} model has no module {name!r}; check "
            "module_name_prefix, teacher_layer and other_module_name against the model's module names"
        ) from None


def _copy(student: nn.Module, teacher: nn.Module, s_name: str, t_name: str) -> None:
    target = dict(_module(student, s_name, "student").named_parameters())
    source = dict(_module(teacher, t_name, "teacher").named_parameters())
    for key in sorted(set(target) | set(source)):
        s_param, t_param = target.get(key), source.get(key)
        if s_param is None or t_param is None or s_param.shape != t_param.shape:
            raise ValueError(
                f"compression_training.layer_reduction: student {s_name}.{key} "
                f"{None if s_param is None else tuple(s_param.shape)} and teacher {t_name}.{key} "
                f"{None if t_param is None else tuple(t_param.shape)} differ; the student's kept layers must be "
                "built like the teacher's"
            )
        with torch.no_grad():
            s_param.copy_(t_param)


def initialize_student(student: nn.Module, teacher: nn.Module | None, plan: LayerReductionPlan) -> None:
    """Copy the teacher's chosen layers, and its other named modules, into `student` (in place)."""
    if teacher is None:
        raise ValueError(
            "compression_training.layer_reduction is enabled but init_compression got no teacher_model; pass "
            "init_compression(student, config, teacher_model=teacher)"
        )
    prefix = plan.module_name_prefix
    for index, teacher_index in enumerate(plan.teacher_layer):
        _copy(student, teacher, f"{prefix}.{index}", f"{prefix}.{teacher_index}")
    for name in plan.other_module_name:
        _copy(student, teacher, name, name)
