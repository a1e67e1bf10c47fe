"""The planner's figures for every candidate, computed inside the profile run where the real model lives.

The tuner writes a request (`{"candidates": {name: config}, "profiled": name, "answer": path, "gpus_per_node":
n}`); the profile run's engine calls `answer_request` after its first optimizer step, on rank 0. Each candidate's
config is resolved as the engine would resolve it and estimated on the engine's own module (stage-3 parameters
keep their global shapes), so the figures are the ones `slipstream plan` prints for that config. On an
accelerator that counts its own allocations, the profile step's peak beyond the planner's figure for the profiled
config is taken as activations, per sample of the micro batch; on the CPU the process's RSS says nothing of that
and activations stay unknown. The profiled config has activation checkpointing off (tuner.py), so that figure is
the full one; a candidate with checkpointing on counts the share the planner's activation model keeps with it
(planner/activations.py: each layer's input plus one layer's activations, `1/layers + 1/17` of the full figure
for a transformer whose layers and width the planner finds in the module). Where the planner finds no layers,
checkpointed activations stay unknown (never counted against the budget, so never the reason for a skip).
The answer also carries the model's profile (profile.py: FLOPs per sample, forward seconds per block, the step's
seconds), from which the ranking estimates each candidate's throughput (throughput.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn

from slipstream.autotuning.files import write_json
from slipstream.autotuning.profile import ModelProfile
from slipstream.autotuning.space import Candidate
from slipstream.planner.activations import transformer_activations
from slipstream.planner.estimate import estimate_option, settings_from_config
from slipstream.planner.shapes import from_module
from slipstream.planner.types import OWNED_ROLES, Settings

__all__ = [
    "Figures",
    "answer_request",
    "checkpointed_share",
    "device_is_host",
    "estimate_config",
    "read_answer",
    "read_profile",
]


def device_is_host() -> bool:
    """Whether the accelerator is the CPU (the planner's own test): device and host are then one memory."""
    return Settings().device_is_host


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Figures:
    """One candidate's bytes per rank (model states from the planner; activations measured or unknown)."""

    device: int
    """Model states on the device, per rank (activations excluded)."""
    host: int
    """Model states on the host, per rank."""
    activations: int | None


def estimate_config(
    config: dict[str, object], *, module: nn.Module, world_size: int, gpus_per_node: int
) -> tuple[int, int]:
    """(device bytes, host bytes) per rank of the planner's model states for `config` on `module`: what
    `engine.optimizer.owned_bytes()` counts (within 5%, tests/dist/planner), split by where it lives. The
    planner's bounds on transient gradients and gathered units are left out, so no candidate is ever skipped
    for a figure the planner only bounds from above; what an NVMe offload keeps in files is in neither."""
    settings, option, _micro = settings_from_config(config, world_size=world_size)
    result = estimate_option(
        from_module(module), option, settings=settings, world=world_size, gpus_per_node=gpus_per_node
    )
    device = sum(result.device.get(role, 0) for role in OWNED_ROLES)
    return device, result.model_states - device - result.nvme_per_rank  # NVMe's bytes are in files, not memory


def checkpointed_share(module: nn.Module) -> float | None:
    """The planner's activations with checkpointing over those without, for `module` (None: no layers found)."""
    dims = from_module(module).dims
    if not dims.hidden or not dims.layers:
        return None
    layers_only = dataclasses.replace(dims, heads=dims.heads or 1, vocab=None)
    full, kept = (
        transformer_activations(
            layers_only, seq=1, micro_batch=1, dtype_bytes=2, fused_attention=True, checkpointing=on
        )
        for on in (False, True)
    )
    return kept / full


def answer_request(
    request_path: str,
    *,
    module: nn.Module,
    world_size: int,
    micro_batch: int,
    peak_memory: int,
    profile: ModelProfile | None = None,
) -> None:
    """Estimate every candidate of the request and write the answer file (see the module's docstring)."""
    request = json.loads(Path(request_path).read_text())
    gpus_per_node = int(request.get("gpus_per_node", 1))
    answer: dict[str, dict[str, int]] = {}
    for name, config in request["candidates"].items():
        device, host = estimate_config(config, module=module, world_size=world_size, gpus_per_node=gpus_per_node)
        answer[name] = {"device": device, "host": host}
    per_sample = None
    if not device_is_host() and peak_memory > 0:
        profiled = answer[request["profiled"]]["device"]
        per_sample = max(0, peak_memory - profiled) // max(micro_batch, 1)
    shape = from_module(module)
    write_json(
        request["answer"],
        {
            "candidates": answer,
            "activations_per_sample": per_sample,
            "checkpointed_share": checkpointed_share(module),
            "profile": None if profile is None else dataclasses.asdict(dataclasses.replace(profile, numel=shape.total)),
        },
    )


def _activations(candidate: Candidate, per_sample: int | None, share: float | None) -> int | None:
    if per_sample is None:
        return None
    if not candidate.activation_checkpointing:
        return per_sample * candidate.micro_batch
    return None if share is None else int(per_sample * candidate.micro_batch * share)


def read_answer(path: Path, candidates: list[Candidate]) -> dict[str, Figures]:
    """The answer file as figures per candidate name."""
    data = json.loads(path.read_text())
    per_sample, share = data.get("activations_per_sample"), data.get("checkpointed_share")
    rows = data["candidates"]
    return {
        c.name: Figures(
            device=int(rows[c.name]["device"]),
            host=int(rows[c.name]["host"]),
            activations=_activations(c, per_sample, share),
        )
        for c in candidates
    }


def read_profile(path: Path) -> ModelProfile | None:
    """The model's profile in the answer file (None: the profile run took none)."""
    found = json.loads(path.read_text()).get("profile")
    return None if not isinstance(found, dict) else ModelProfile(**found)
