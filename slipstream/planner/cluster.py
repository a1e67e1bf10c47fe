"""The cluster the communication model runs on: nodes, GPUs per node, link bandwidths and peak FLOP/s.

Owns the parsing of the `slipstream plan --cluster` units ("900GB/s", "400Gb/s", "990e12", "990TFLOPS") and the
`Cluster` value the cost model (planner/comm_model.py) reads. Bandwidths are bytes per second, one direction:
`intra` is what one GPU sends inside its node (NVLink), `inter` is what one node sends to the others (all of its
network cards together), so the GPUs of a node share it in the inter-node phase of a collective.
"""

from __future__ import annotations

import dataclasses
import re

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)"


def parse_bandwidth(text: str, *, name: str = "bandwidth") -> float:
    """Bytes per second from "900GB/s" (bytes), "400Gb/s" or "400Gbps" (bits), "50GB" or a plain 5e10 (bytes/s)."""
    match = re.fullmatch(rf"\s*{_NUMBER}\s*([kKmMgGtTpP]?)\s*(B|b|bit|bits|Byte|Bytes)?\s*(/s|ps)?\s*", str(text))
    if match is None:
        raise ValueError(
            f"{name} {text!r} is not a bandwidth; write e.g. 900GB/s (bytes), 400Gb/s or 400Gbps (bits), or 5e10"
        )
    number, prefix, unit = float(match.group(1)), match.group(2).upper(), match.group(3) or "B"
    value = number * _SCALE[prefix] / (8.0 if unit in ("b", "bit", "bits") else 1.0)
    if value <= 0:
        raise ValueError(f"{name} {text!r} must be above zero")
    return value


def parse_flops(text: str, *, name: str = "flops") -> float:
    """Peak FLOP/s of one GPU from "990e12", "990T", "990TFLOPS" or "0.99PFLOP/s"."""
    match = re.fullmatch(rf"\s*{_NUMBER}\s*([kKmMgGtTpP]?)\s*(?:FLOPS|FLOP/s|flops|flop/s)?\s*", str(text))
    if match is None:
        raise ValueError(f"{name} {text!r} is not a FLOP/s figure; write e.g. 990e12, 990T or 990TFLOPS")
    value = float(match.group(1)) * _SCALE[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{name} {text!r} must be above zero")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs; bandwidths in bytes/s (one direction), `flops` per GPU, `mfu` the share of
    it the model's matrix work reaches (the compute time is 6 x params x tokens / (flops x mfu))."""

    nodes: int
    gpus_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    flops: float
    mfu: float = 0.5

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"Cluster.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("intra_bandwidth", "inter_bandwidth", "flops"):
            if getattr(self, key) <= 0:
                raise ValueError(f"Cluster.{key} must be above zero, got {getattr(self, key)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Cluster.mfu must be in (0, 1], got {self.mfu}; a typical figure is 0.4-0.6")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_per_gpu(self) -> float:
        """What one GPU gets of its node's network while every GPU of the node sends across at once."""
        return self.inter_bandwidth / self.gpus_per_node
