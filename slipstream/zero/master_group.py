"""`MasterGroup`: what every stage's optimizer-facing group has in common (stages 0-2 `FlatGroup`, stage 3
`Stage3Group`): the fp32 master pieces, the owned gradients, and with offload their host copies.

A subclass sets `master_pieces`, `owned_grads`, `grad_storage`, `master_flat` (or None when the masters alias
the parameters), `offload` and `dtype`, and says how a flat buffer of its owned elements splits into pieces.
Stage 3 may cut its masters into sub-groups (`sub_groups`: [start, end) ranges of master pieces, each with its
own buffer in `master_buffers`, so NVMe offload can swap them one at a time); other groups are one sub-group.
"""

from __future__ import annotations

import abc

import torch

from slipstream.offload.policy import OffloadPolicy


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MasterGroup(abc.ABC):
    master_pieces: list[torch.Tensor]
    owned_grads: list[torch.Tensor]
    grad_storage: torch.Tensor
    master_flat: torch.Tensor | None
    offload: OffloadPolicy
    dtype: torch.dtype

    @property
    def master_buffers(self) -> list[torch.Tensor]:
        """The storages holding the master pieces (one per sub-group); empty when they alias the parameters."""
        return [] if self.master_flat is None else [self.master_flat]

    @property
    def sub_groups(self) -> list[tuple[int, int]]:
        """[start, end) ranges of `master_pieces` stepped (and swapped) together."""
        return [(0, len(self.master_pieces))]

    @abc.abstractmethod
    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat buffer of the owned elements, cut into one piece per master piece."""

    def _allocate_host_buffers(self, owned_numel: int, master_dtype: torch.dtype) -> None:
        """With offload the optimizer reads host copies of the owned gradients and may write the updated values,
        cast to the parameter dtype, into a host staging buffer (see offload/policy.py)."""
        self.host_grad_pieces: list[torch.Tensor] = []
        self.low_precision_pieces: list[torch.Tensor] = []
        if self.offload.on_host:
            cpu = torch.device("cpu")
            if self.grad_storage.device.type == "cpu" and self.grad_storage.dtype == master_dtype:
                # the gradients already are host memory of the master dtype (the CPU accelerator): no copy
                self.host_grad_pieces = list(self.owned_grads)
            else:
                self.host_grad_pieces = self._split(self.offload.allocate(owned_numel, master_dtype, cpu))
            if self.dtype != master_dtype:
                self.low_precision_pieces = self._split(self.offload.allocate(owned_numel, self.dtype, cpu))

    def grads_for_optimizer(self) -> list[torch.Tensor]:
        """The owned gradients in the master dtype, where the master pieces live (host copies with offload)."""
        if self.offload.on_host:
            for host, grad in zip(self.host_grad_pieces, self.owned_grads):
                if host is not grad:
                    host.copy_(grad, non_blocking=True)
            return self.host_grad_pieces
        return [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(self.master_pieces, self.owned_grads)]

    def _param_bytes(self) -> int:
        """Bytes of parameter storage this group owns (stage 3's shards belong to the units instead)."""
        return 0

    def owned_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this group owns, by role (for the memory tests and the planner)."""
        master = _nbytes(self.master_buffers)
        return {
            "params": self._param_bytes(),
            "master": master,
            "grads": _nbytes([self.grad_storage]),
            "host_buffers": _nbytes([h for h, g in zip(self.host_grad_pieces, self.owned_grads) if h is not g])
            + _nbytes(self.low_precision_pieces),
        }
