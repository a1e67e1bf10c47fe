"""The ranking's throughput estimate from the model's profile (profile.py): samples per second of each candidate.

[Note: the profiled estimate]
Per optimizer step of a candidate with micro batch m and accumulation g on d data-parallel ranks:

    g x (compute(m) + communication per micro step + parameter fetches) + communication per step
        + optimizer offload + fixed

- compute(m): the profiled forward (every block and the rest) scaled by m / m0 (m0 the profiled micro batch),
  times 3 (a backward is two forwards, as the planner's cost model counts), plus the blocks' forward once more
  when activation checkpointing is on (the recompute covers the blocks, not the embeddings or the head).
- communication: planner/comm_model.py's collectives of the stage for the model's parameters on d ranks
  (`ranks_per_node` per node) at `Links.collective` bytes/s, nothing hidden behind compute: stage 0 reduces the
  gradients once per step, stage 1 reduce-scatters them per step and stage 2 per micro step, both gather the
  parameters after the step, stage 3 gathers the parameters in the forward and the backward of every micro step.
- offload: the optimizer offloaded moves its gradient shard to the host and the parameter shard back
  (`Links.host`) and steps on the host (`Links.host_step` parameters/s); on NVMe its masters and two states are
  read and written too (`Links.nvme`); the parameters offloaded are fetched in the forward and the backward of
  every micro step (over `Links.host`, or `Links.nvme`).
- fixed: what the profiled step measured beyond what this model gives for the profiled candidate (the optimizer
  on the device, the framework's per-step work), the same for every candidate.
The link figures are assumed per kind of accelerator (`default_links`), not measured; the trials measure, the
estimate only picks the few that run (and `model_based` corrects it from them, order.py).
"""

from __future__ import annotations

import dataclasses

from slipstream.autotuning.profile import REST, ModelProfile
from slipstream.autotuning.space import Candidate
from slipstream.planner.cluster import Cluster
from slipstream.planner.comm_model import Variant, transfers

__all__ = ["CPU_LINKS", "GPU_LINKS", "BACKWARD_FORWARDS", "Links", "ProfiledEstimate", "default_links"]

BACKWARD_FORWARDS = 2.0
"""A backward costs two forwards (the gradients of the inputs and of the weights)."""
NVME_STATE_BYTES = 2 * 12
"""Bytes per parameter an NVMe optimizer step reads and writes: the fp32 master and two Adam states."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Links:
    """Assumed speeds (bytes/s unless said) of the links the estimate charges."""

    collective: float
    """What one rank sends per second in a collective."""
    host: float
    """Device <-> host copies."""
    nvme: float
    """Host <-> NVMe."""
    host_step: float
    """Parameters per second the CPU optimizer steps."""


CPU_LINKS = Links(collective=1e9, host=5e9, nvme=1e9, host_step=2e8)
"""gloo over loopback, memory copies, a local SSD, the CPU Adam."""
GPU_LINKS = Links(collective=50e9, host=12e9, nvme=2e9, host_step=1e9)
"""NVLink-class collectives, PCIe to the host."""


def default_links(device_is_host: bool) -> Links:
    return CPU_LINKS if device_is_host else GPU_LINKS


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfiledEstimate:
    """Samples per second of a candidate from `profile` (see [Note: the profiled estimate])."""

    profile: ModelProfile
    profiled: Candidate
    """The candidate the profile run ran (its modelled step is what the measured step is compared with)."""
    world: int
    """Data-parallel ranks."""
    ranks_per_node: int
    links: Links

    def compute(self, candidate: Candidate) -> float:
        """Seconds of compute per micro step."""
        scale = candidate.micro_batch / self.profile.micro_batch
        forward = self.profile.forward_s * scale
        blocks = sum(s for name, s in self.profile.block_forward_s.items() if name != REST) * scale
        return forward * (1.0 + BACKWARD_FORWARDS) + (blocks if candidate.activation_checkpointing else 0.0)

    def communication(self, candidate: Candidate) -> tuple[float, float]:
        """Seconds of collectives (per micro step, per step)."""
        per_node = max(1, min(self.world, self.ranks_per_node))
        nodes = max(1, self.world // per_node)
        cluster = Cluster(
            nodes=nodes,
            gpus_per_node=per_node,
            intra_bandwidth=self.links.collective,
            inter_bandwidth=self.links.collective * per_node,
            flops=1.0,
        )
        size = self.profile.param_bytes
        moves = transfers(
            Variant(name=candidate.name, stage=candidate.stage),
            numel=self.profile.numel,
            param_bytes=size,
            grad_bytes=size,
            cluster=cluster,
        )
        return sum(t.seconds for t in moves if t.per_micro), sum(t.seconds for t in moves if not t.per_micro)

    def offload(self, candidate: Candidate) -> tuple[float, float]:
        """Seconds of host and NVMe traffic and of the host's optimizer step (per micro step, per step)."""
        shard, links = self.profile.numel / self.world, self.links
        fetch = links.nvme if candidate.offload_device == "nvme" else links.host
        per_micro = 2 * shard * self.profile.param_bytes / fetch if candidate.offload_param else 0.0
        per_step = 0.0
        if candidate.offload_optimizer:
            per_step = shard * (4 + self.profile.param_bytes) / links.host + shard / links.host_step
            per_step += shard * NVME_STATE_BYTES / links.nvme if candidate.offload_device == "nvme" else 0.0
        return per_micro, per_step

    def modelled_step(self, candidate: Candidate) -> float:
        """Seconds of one optimizer step without the fixed part."""
        comm_micro, comm_step = self.communication(candidate)
        off_micro, off_step = self.offload(candidate)
        return candidate.grad_accum * (self.compute(candidate) + comm_micro + off_micro) + comm_step + off_step

    def fixed(self) -> float:
        """The measured step's seconds beyond the profiled candidate's modelled step (never below zero)."""
        return max(0.0, self.profile.step_s - self.modelled_step(self.profiled))

    def __call__(self, candidate: Candidate) -> float:
        seconds = self.modelled_step(candidate) + self.fixed()
        samples = candidate.micro_batch * candidate.grad_accum * self.world
        return samples / seconds if seconds > 0 else float(samples)
