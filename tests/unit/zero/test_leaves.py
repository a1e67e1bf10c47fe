"""ZeRO-3 leaf modules: marking by class, name and suffix (DeepSpeed's `deepspeed.utils` names), the
`zero_optimization.leaf_module` section, and how leaves shape the units (zero/stage3/leaves.py, units.py)."""

from __future__ import annotations

import pytest
from torch import nn

from slipstream.config.schema.zero import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig, ZeroConfig
from slipstream.zero.stage3.leaves import (
    apply_leaf_settings,
    get_z3_leaf_modules,
    leaf_matches,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from slipstream.zero.stage3.units import plan_units


class Base(nn.Module):
    pass


class Inner(Base):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.moe = Inner()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.inner = Inner()
        self.head = nn.Linear(4, 2)


def _units(model: nn.Module) -> list[str]:
    return [spec.name for spec in plan_units(model, threshold=0)]


def test_mark_by_class_subclass_name_and_qualified_name() -> None:
    for wanted in (Inner, Base, "Inner", f"{Inner.__module__}.{Inner.__qualname__}"):
        model = Net()
        marked = set_z3_leaf_modules(model, [wanted])
        assert marked == [model.blocks[0].moe, model.blocks[1].moe, model.inner], wanted
        assert get_z3_leaf_modules(model) == marked and not z3_leaf_module(model)
    model = Net()
    assert set_z3_leaf_modules(model, [Net]) == [model] and z3_leaf_module(model)  # the root itself


def test_no_match_raises_unless_told_not_to() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"no module of class \['Conv2d'\]"):
        set_z3_leaf_modules(model, ["Conv2d"])
    assert set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])  # type: ignore[list-item]


def test_unset_clears_only_the_named_classes() -> None:
    model = Net()
    set_z3_leaf_modules(model, [Inner, nn.ModuleList])
    assert len(unset_z3_leaf_modules(model, [nn.ModuleList])) == 1
    assert get_z3_leaf_modules(model) == [model.blocks[0].moe, model.blocks[1].moe, model.inner]


def test_by_name_and_by_suffix_return_matches_and_misses() -> None:
    model = Net()
    assert set_z3_leaf_modules_by_name(model, ["inner", "nope"], raise_if_not_found=False) == (
        [model.inner],
        ["nope"],
    )
    with pytest.raises(ValueError, match=r"no module named \['nope'\]"):
        set_z3_leaf_modules_by_name(Net(), ["inner", "nope"])
    model = Net()
    matched, missing = set_z3_leaf_modules_by_suffix(model, ["moe", "proj", "zzz"], raise_if_not_found=False)
    moes = [model.blocks[0].moe, model.blocks[1].moe]
    projs = [model.blocks[0].moe.proj, model.blocks[1].moe.proj, model.inner.proj]
    assert matched == moes + projs and missing == ["zzz"]
    assert all(z3_leaf_module(m) for m in matched) and not z3_leaf_module(model.inner)
    set_z3_leaf_modules_by_suffix(model, ["moe"], flag=False)
    assert not any(z3_leaf_module(m) for m in moes)


def test_leaf_module_section_defaults_coercion_and_repeats() -> None:
    section = ZeroConfig().leaf_module
    assert section.classes == DEFAULT_LEAF_MODULE_CLASSES and section.names == [] and section.name_suffixes == []
    section = ZeroConfig(leaf_module={"classes": "a.B", "names": ["x", "x", "y"], "name_suffixes": "tail"}).leaf_module
    assert (section.classes, section.names, section.name_suffixes) == (["a.B"], ["x", "y"], ["tail"])
    with pytest.raises(ValueError, match="mapping"):
        LeafModuleConfig.model_validate(["a.B"])


def test_config_settings_mark_and_unmatched_ones_are_named() -> None:
    model = Net()
    found, missing = leaf_matches(model, [*DEFAULT_LEAF_MODULE_CLASSES, "Inner"], ["head"], ["blocks"])
    assert [name for name, _ in found] == ["blocks", "blocks.0.moe", "blocks.1.moe", "inner", "head"]
    assert missing == []  # the default (Hugging Face) classes are not reported when the model has none
    with pytest.raises(ValueError, match="class Nope, suffix zzz match no module"):
        apply_leaf_settings(Net(), ["Nope", "Inner"], [], ["zzz"])
    model = Net()
    assert apply_leaf_settings(model, ["Inner"]) == [model.blocks[0].moe, model.blocks[1].moe, model.inner]


def test_leaves_are_units_where_the_walk_meets_them() -> None:
    model = Net()
    assert _units(model) == ["embed", "blocks.0", "blocks.1", "inner", "head", "<root>"]
    set_z3_leaf_modules(model, [Inner])  # inside the blocks they stay inside their block's unit
    assert _units(model) == ["embed", "blocks.0", "blocks.1", "inner", "head", "<root>"]
    model = Net()
    set_z3_leaf_modules_by_name(model, ["blocks"])  # a leaf container is one unit, not one per element
    assert _units(model) == ["embed", "blocks", "inner", "head", "<root>"]


def test_a_leaf_root_is_one_unit() -> None:
    model = Net()
    set_z3_leaf_modules(model, [Net])
    (spec,) = plan_units(model, threshold=0)
    assert spec.name == "<root>" and [n for n, _ in spec.params] == [n for n, _ in model.named_parameters()]
    small = plan_units(model, threshold=5)  # biases (4 elements) stay persistent, the rest in the root unit
    assert [s.name for s in small] == ["<root>", "<persistent>"]
    assert all(p.numel() < 5 for _, p in small[1].params)


def test_planner_uses_the_same_leaves_without_marking_the_model() -> None:
    from slipstream.planner.shapes import plan_unit_shapes

    model = Net()
    shapes = plan_unit_shapes(model, threshold=0, leaf_suffixes=("blocks",))
    assert [s.name for s in shapes] == ["embed", "blocks", "inner", "head", "<root>"]
    assert get_z3_leaf_modules(model) == []  # marked only while planning
    with_classes = plan_unit_shapes(model, threshold=0, leaf_classes=(f"{__name__}.Net",))
    assert [s.name for s in with_classes] == ["<root>"]
