"""Whole-model weights out of the engine: `save_16bit_model` and `_zero3_consolidated_16bit_state_dict`.

At stages 0-2 every rank holds the whole model, so this is the module's state dict. At stage 3 the
parameters are gathered one unit at a time onto rank 0's host, only when
`zero_optimization.stage3_gather_16bit_weights_on_model_save` is true (as in DeepSpeed); otherwise
`save_16bit_model` returns False with a warning. Never is an empty or partial state dict written
(docs/design.md P4): a parameter that cannot be gathered raises instead.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from slipstream.comm import collectives
from slipstream.utils.logging import warn_once


class ModelSaving:
    """Mixin of the engine; uses `self.module`, `self.zero_model`, `self.global_rank`, `self.plan`."""

    module: Any
    zero_model: Any
    global_rank: int
    plan: Any
    parallel: Any

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict (parameters gathered, buffers) on rank 0; an empty dict on the other ranks.
        With tensor parallelism the tensors are global (the TP shards all-gathered), so they load at TP=1."""
        if self.zero_model is None:
            whole = self.parallel.full_state(self.module, OrderedDict(self.module.state_dict()))
            return whole if self.global_rank == 0 else OrderedDict()
        params = self.zero_model.full_state(exclude_frozen=exclude_frozen_parameters)
        if self.zero_model.rank != 0:  # the data group's first ranks hold the gathered values (one TP group)
            return OrderedDict()
        state: dict[str, torch.Tensor] = OrderedDict()
        for name, param in self.module.named_parameters():
            if exclude_frozen_parameters and not param.requires_grad:
                continue
            gathered = params.get(param.ds_record.name)  # keyed by the name its unit knows it by
            if gathered is None:
                raise RuntimeError(
                    f"consolidating the ZeRO-3 model left out parameter '{name}': refusing to return "
                    "a partial state dict"
                )
            state[name] = gathered
        for name, buffer in self.module.named_buffers():
            state[name] = buffer.detach().to("cpu", copy=True)
        state = self.parallel.full_state(self.module, state)
        return state if self.global_rank == 0 else OrderedDict()

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the full 16-bit (model dtype) weights; at stage 3 only with gather_16bit_weights_on_model_save."""
        stage3 = self.plan.zero.stage3
        if self.zero_model is not None and not (stage3 and stage3.gather_16bit_on_save):
            warn_once(
                "save-16bit",
                "slipstream: save_16bit_model did nothing: at ZeRO stage 3 it needs "
                '"stage3_gather_16bit_weights_on_model_save": true in zero_optimization (gathering the whole '
                "model costs time and host memory on rank 0); use save_checkpoint otherwise",
            )
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            temporary = f"{path}.tmp-{os.getpid()}"
            torch.save(state, temporary)
            os.replace(temporary, path)
        if torch.distributed.get_world_size() > 1:
            collectives.barrier()
        return True
