"""Every config key a schema section honours (`IMPLEMENTED`: key -> plan field) becomes a plan field that some
component reads; every plan field is honoured or derived. A key that no component reads would be a silent
no-op: these tests make it red."""

from __future__ import annotations

import ast
import dataclasses
import sys
import types
import typing
from pathlib import Path

import pytest

from slipstream.config import plan as plan_module
from slipstream.config.keys import _json_key
from slipstream.config.plan import EnginePlan, NvmeTarget, OffloadTarget
from slipstream.config.schema.base import model_of
from slipstream.config.schema.top import DeepSpeedConfig

PACKAGE = Path(__file__).resolve().parents[3] / "slipstream"
DERIVED = {
    "batch.world_size": "the data-parallel size given to resolve()",
    "batch.sources": "how each batch number was obtained (logged)",
    "precision.master_dtype": "fp32 masters (bf16 masters are reported as not implemented)",
    "precision.loss_scale": "present iff fp16.enabled",
    "zero.stage3": "present iff zero_optimization.stage is 3",
    "optimizer": "present iff the config has an optimizer section",
    "scheduler": "present iff the config has a scheduler section",
    "logging.monitor": "the monitor sections",
    "unimplemented": "keys reported as not implemented",
    "resolved": "the resolved config as DeepSpeed clients read it back",
    "compile": "the compile section (engine.compile() reads it)",
    "compile.deepcompile": "compile.deepcompile stays reported; engine.compile() refuses DeepCompile by name",
    "schedules.dynamic_batching.seed": "data_efficiency.seed (honoured as schedules.sampling.seed)",
    "schedules.dynamic_batching.num_workers": "data_sampling.num_workers (honoured as schedules.sampling.num_workers)",
}
DERIVED_TREES = {
    "sparse_attention": "the sparse_attention section as a whole: its mode and that mode's keys",
    "zero.stage3.offload_param.aio": "the same aio section as zero.offload_optimizer.aio",
    "batch.sources": "a dict",
    "zero.stage3.loco": "zeropp_loco_param, a dict: err_beta and reset_T (config/zero_plans.py loco_plan)",
}


def _honoured(cls: type = DeepSpeedConfig, prefix: str = "") -> dict[str, str]:
    """Dotted DeepSpeed key -> plan field, from every section's IMPLEMENTED table."""
    found: dict[str, str] = {}
    implemented = cls.IMPLEMENTED  # type: ignore[attr-defined]
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        key = prefix + _json_key(cls, name)  # type: ignore[arg-type]
        if name in implemented:
            found[key] = implemented[name]
        sub = model_of(info.annotation)
        if sub is not None:
            found.update(_honoured(sub, key + "."))
    return found


HONOURED = {key: path for key, path in _honoured().items() if path}
RESOLVE_ONLY = {"strict": "decides whether unknown keys are errors or warnings while resolving"}


def _field_type(owner: type, name: str) -> type | None:
    """The class of field `name` of dataclass `owner` (Optional unwrapped; offload targets as NvmeTarget)."""
    if isinstance(owner, type) and issubclass(owner, OffloadTarget):
        owner = NvmeTarget
    hints = typing.get_type_hints(owner, {**vars(plan_module), **vars(sys.modules[owner.__module__])})
    if name not in hints:
        return None
    hint = hints[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    is_union = typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType)
    hint = args[0] if is_union and len(args) == 1 else hint
    return hint if isinstance(hint, type) else object


def _resolves(path: str) -> bool:
    owner: type | None = EnginePlan
    for part in path.split("."):
        if owner is None or not (dataclasses.is_dataclass(owner) or issubclass(owner, OffloadTarget)):
            return False
        owner = _field_type(owner, part)
        if owner is None:
            return False
    return True


def _leaf_paths(owner: type = EnginePlan, prefix: str = "") -> set[str]:
    paths: set[str] = set()
    fields = dataclasses.fields(NvmeTarget if owner is OffloadTarget else owner)  # type: ignore[arg-type]
    for field in fields:
        path = prefix + field.name
        paths.add(path)
        kind = _field_type(owner, field.name)
        if kind is not None and kind is not object and (dataclasses.is_dataclass(kind) or kind is OffloadTarget):
            paths |= _leaf_paths(kind, path + ".")
    return paths


def _attributes_read_outside_config() -> set[str]:
    names: set[str] = set()
    for source in PACKAGE.rglob("*.py"):
        if "config" in source.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def test_only_resolve_time_keys_have_no_plan_field() -> None:
    assert {key for key, path in _honoured().items() if not path} == set(RESOLVE_ONLY)
    assert "zero_optimization.stage3_prefetch_bucket_size" in HONOURED  # DeepSpeed's spelling of aliased keys


@pytest.mark.parametrize("key", sorted(HONOURED))
def test_each_honoured_key_names_a_real_plan_field(key: str) -> None:
    assert _resolves(HONOURED[key]), f"{key} -> {HONOURED[key]}: no such field under EnginePlan"


def test_each_honoured_field_is_read_by_a_component() -> None:
    read = _attributes_read_outside_config()
    unread = sorted(f"{key} -> {path}" for key, path in HONOURED.items() if path.rsplit(".", 1)[-1] not in read)
    assert not unread, f"honoured keys whose plan field no component reads (silent no-ops): {unread}"


def test_every_plan_field_is_honoured_or_derived() -> None:
    targets = set(HONOURED.values())
    covered = {t.rsplit(".", depth)[0] for t in targets for depth in range(t.count(".") + 1)} | targets
    dead = sorted(p for p in _leaf_paths() if p not in covered and p not in DERIVED
                  and not any(p == d or p.startswith(d + ".") for d in DERIVED_TREES))
    assert not dead, f"plan fields that no honoured key fills (remove them or honour a key): {dead}"


def test_the_checks_can_fail() -> None:
    """The helpers see a missing field and an unread attribute (so the tests above are not vacuous)."""
    assert not _resolves("zero.allgather_bucket_size")
    assert "surely_not_an_attribute_anyone_reads" not in _attributes_read_outside_config()
    assert "zero.reduce_bucket_size" in _leaf_paths()


def _plan_classes() -> list[type]:
    return [cls for cls in vars(plan_module).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)]


def test_plan_fields_have_no_defaults_of_their_own() -> None:
    """A plan field with a default would be a second place a knob is defaulted (the schema is the one place):
    resolve() fills every field from the schema."""
    defaulted = sorted(
        f"{cls.__name__}.{field.name}"
        for cls in _plan_classes()
        for field in dataclasses.fields(cls)
        if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )
    assert not defaulted, f"plan fields with a default of their own (resolve() fills them from the schema): {defaulted}"
    assert "Stage3Plan" in {cls.__name__ for cls in _plan_classes()}
