"""Bytes of device memory an engine holds: every tensor storage reachable from the engine object, counted once.

Written independently of what `engine.offload_states()` knows (zero/state_buffers.py): it walks the engine's
attributes, containers and modules (parameters, buffers, gradients, the optimizers and their state, the ZeRO
groups and units, staging rings, pools) and sums the bytes of the distinct storages on `device`. Host copies
made by the offload are reachable too, under the attribute `_offloaded_states`; `skip` names attributes left
out (the test passes that one, so what it counts is the engine's own device memory).
"""

from __future__ import annotations

import torch

_LEAVES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def device_bytes(root: object, *, device: torch.device, skip: frozenset[str] = frozenset()) -> int:
    from slipstream.zero.stage3.sharded_param import internal_access  # ZeRO-3 parameters refuse storage access

    with internal_access():
        return _walk(root, device=device, skip=skip)


def _walk(root: object, *, device: torch.device, skip: frozenset[str]) -> int:
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device.type:
                storage = obj.untyped_storage()
                key = storage.data_ptr() or id(obj)  # a released storage (0 bytes) still counts as 0
                storages[key] = max(storages.get(key, 0), storage.nbytes())
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("slipstream", "torch", "transformers", "tests"):
            attributes = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    attributes[slot] = getattr(obj, slot)
            stack.extend(value for name, value in attributes.items() if name not in skip)
    return sum(storages.values())
