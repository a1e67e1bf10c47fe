"""The optimizer registry: the one table that says which optimizers exist, how they are built, what state they
keep, and what ZeRO may do with them. resolve.py, the engine's builders and the planner all read it.

An entry names the class by import path ("module:attr"), so the config layer imports no torch and no engine
code; `slipstream.engine.optimizers` imports the class when the engine builds it.

[Note: optimizer defaults]
DeepSpeed's own optimizers (FusedAdam, DeepSpeedCPUAdam, FusedLamb, FusedLion) default `weight_decay` to 0.
torch.optim.AdamW defaults it to 0.01. A config's `adam`/`adamw` without `weight_decay` therefore gets 0 on
every path here (device or CPU offload), as in DeepSpeed; with `"torch_adam": true` DeepSpeed builds
torch's class with torch's defaults, and so do we (resolve keeps `torch_adam` in the plan's params for the
engine). Without it, `adam`/`adamw` build `slipstream.ops.adam.FusedAdam` (DeepSpeed's class name; torch's
fused kernels), with `adam_w_mode` from the name.

Adding an optimizer: one `OptimizerSpec` below (plus the class, when it is our own), and a test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEEPSPEED_ONLY",
    "OptimizerSpec",
    "REGISTRY",
    "compresses",
    "is_muon_matrix",
    "spec_for",
    "spec_for_class",
    "states_per_element",
]


def _fixed(count: int) -> Callable[[Mapping[str, Any]], int]:
    return lambda params: count


def _adam_states(params: Mapping[str, object]) -> int:
    return 3 if params.get("amsgrad") else 2


def _momentum_states(params: Mapping[str, Any]) -> int:
    return int(float(params.get("momentum", 0) or 0) > 0)


def is_muon_matrix(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's rule for which parameters Muon updates: matrices (2-D and up) whose name has neither 'embed'
    nor 'lm_head'; the rest take Muon's AdamW."""
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def _muon_states(params: Mapping[str, object]) -> float:
    """One momentum buffer per element of a Muon matrix (a param group with use_muon), Adam's two per other
    element; over a whole model, 2 minus the share of its trainable elements in Muon matrices (`muon_share`,
    which the planner fills in from the model)."""
    if "use_muon" in params:
        return 1 if params["use_muon"] else 2
    share = params.get("muon_share", 0.0)
    return 2.0 - (float(share) if isinstance(share, (int, float)) else 0.0)


def _rmsprop_states(params: Mapping[str, object]) -> int:
    return 1 + _momentum_states(params) + int(bool(params.get("centered")))


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """One optimizer the config can name."""

    name: str
    """The canonical name: DeepSpeed's lower-case name, or a torch.optim class name as torch spells it."""
    target: str
    """Import path of the class, "module:attr"."""
    states: Callable[[Mapping[str, Any]], float]
    """Full-size state tensors kept per parameter element, given the optimizer's params (the planner's count;
    an average over the model where it differs by parameter, as Muon's)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed's defaults where they differ from the class's own (see [Note: optimizer defaults])."""
    elementwise: bool = True
    """The update of each element depends only on that element: ZeRO's flat shards do not change its math.
    Per-tensor optimizers need `zero_allow_untested_optimizer` (Adafactor's factored moments), unless their
    class steps pieces through ZeRO's whole-tensor map (`wants_whole_tensors`: slipstream/optim's LAMB and
    Muon; [Note: whole-tensor map] in zero/whole_tensors.py)."""
    host_target: str | None = None
    """Class that runs this optimizer on the host under offload_optimizer (the CPU Adam op), if any."""
    class_names: tuple[str, ...] = ()
    """Class names of built instances that count as this optimizer (for client optimizers)."""
    min_torch: tuple[int, int] | None = None
    """Oldest torch (major, minor) that has the class."""
    compresses: bool = False
    """After its warm-up it communicates through the 1-bit compressed all-reduce (optim/onebit/), whose error and
    staging buffers the planner counts (planner/zero_bytes.py `compressed_allreduce_bytes`)."""


def _onebit(name: str, class_name: str, *, states: int, aliases: tuple[str, ...] = ()) -> OptimizerSpec:
    """A 1-bit optimizer of slipstream/optim/onebit/ (ZeRO stage 0, and 1-bit Adam stage 1: zero/build.py refuses
    the others)."""
    return OptimizerSpec(
        name=name,
        target=f"slipstream.optim.onebit:{class_name}",
        states=_fixed(states),
        class_names=(class_name, *aliases),
        compresses=True,
    )


_ADAM_DEFAULTS = {"weight_decay": 0.0}
_ENTRIES = (
    OptimizerSpec(
        name="adamw",
        target="slipstream.ops.adam:FusedAdam",
        states=_adam_states,
        defaults=_ADAM_DEFAULTS,
        host_target="slipstream.ops.adam:DeepSpeedCPUAdam",
        class_names=("AdamW", "DeepSpeedCPUAdam", "FusedAdam"),
    ),
    OptimizerSpec(
        name="adam",
        target="slipstream.ops.adam:FusedAdam",
        states=_adam_states,
        defaults=_ADAM_DEFAULTS,
        host_target="slipstream.ops.adam:DeepSpeedCPUAdam",
        class_names=("Adam",),
    ),
    OptimizerSpec(name="sgd", target="torch.optim:SGD", states=_momentum_states, class_names=("SGD",)),
    OptimizerSpec(name="adagrad", target="torch.optim:Adagrad", states=_fixed(1), class_names=("Adagrad",)),
    OptimizerSpec(
        name="lamb",
        target="slipstream.optim.lamb:FusedLamb",
        states=_fixed(2),
        elementwise=False,
        class_names=("Lamb", "FusedLamb"),
    ),
    OptimizerSpec(
        name="muon",
        target="slipstream.optim.muon:MuonWithAuxAdam",
        states=_muon_states,
        elementwise=False,
        class_names=("MuonWithAuxAdam", "Muon"),
    ),
    OptimizerSpec(
        name="lion", target="slipstream.engine.optimizers:Lion", states=_fixed(1), class_names=("Lion", "FusedLion")
    ),
    OptimizerSpec(
        name="adafactor",
        target="torch.optim:Adafactor",
        states=_fixed(1),
        elementwise=False,
        class_names=("Adafactor",),
        min_torch=(2, 5),
    ),
    _onebit("onebitadam", "OneBitAdam", states=2, aliases=("OnebitAdam",)),
    _onebit("zerooneadam", "ZeroOneAdam", states=3),
    _onebit("onebitlamb", "OneBitLamb", states=3, aliases=("OnebitLamb",)),
    # torch.optim classes by their torch names (DeepSpeed passes unknown names to torch.optim as well).
    OptimizerSpec(name="Adamax", target="torch.optim:Adamax", states=_fixed(2), class_names=("Adamax",)),
    OptimizerSpec(name="NAdam", target="torch.optim:NAdam", states=_fixed(2), class_names=("NAdam",)),
    OptimizerSpec(name="RAdam", target="torch.optim:RAdam", states=_fixed(2), class_names=("RAdam",)),
    OptimizerSpec(name="RMSprop", target="torch.optim:RMSprop", states=_rmsprop_states, class_names=("RMSprop",)),
    OptimizerSpec(name="ASGD", target="torch.optim:ASGD", states=_fixed(1), class_names=("ASGD",)),
    OptimizerSpec(name="Adadelta", target="torch.optim:Adadelta", states=_fixed(2), class_names=("Adadelta",)),
)
REGISTRY: dict[str, OptimizerSpec] = {spec.name: spec for spec in _ENTRIES}

DEEPSPEED_ONLY = ("muadam", "muadamw", "musgd")
"""DeepSpeed optimizer names that Slipstream accepts in a config but does not implement (reported when set)."""


def spec_for(name: str) -> OptimizerSpec | None:
    """The entry for a config's `optimizer.type`: DeepSpeed names case-insensitively, torch names as spelled."""
    return REGISTRY.get(name.lower()) or REGISTRY.get(name)


def spec_for_class(class_name: str) -> OptimizerSpec | None:
    """The entry whose built instances have this class name (any case; a client's optimizer), if any."""
    wanted = class_name.lower()
    for spec in _ENTRIES:
        if wanted in (n.lower() for n in spec.class_names):
            return spec
    return None


def states_per_element(name: str, params: Mapping[str, object] = {}) -> float:
    """Full-size state tensors per master element for an optimizer name or class name (2 when unknown)."""
    spec = _lookup(name)
    return 2 if spec is None else spec.states(params)


def compresses(name: str) -> bool:
    """The optimizer (a name or class name) runs the 1-bit compressed all-reduce (`OptimizerSpec.compresses`)."""
    spec = _lookup(name)
    return spec is not None and spec.compresses


def _lookup(name: str) -> OptimizerSpec | None:
    return spec_for(name) or spec_for_class(name)
