"""Activations and their gradients between stages: any pytree of tensors (tuples, lists, dicts with string
keys, and constants), with shapes that may change from one micro-batch to the next.

One transfer is: a header (an int64 tensor with the byte length of the description), the description (a
JSON text: the tree with each tensor's shape, dtype and requires_grad), then each tensor. With
`dynamic_shape=False` the description is sent only when it differs from the last one sent for that (stage,
direction); a header of 0 says "as before". Every message of one transfer has its own tag, derived from the direction, the virtual stage, the
micro-batch and its position, so messages never match the wrong receive.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from slipstream.comm import p2p

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_PARTS = 1024  # messages per transfer (2 + the tensors)
_MICROS = 4096  # micro-batches per batch that tags can tell apart


def flatten(tree: object) -> tuple[Any, list[torch.Tensor]]:
    """(a JSON-able description with tensor slots, the tensors in order)."""
    tensors: list[torch.Tensor] = []

    def walk(node: object) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            dtype = str(node.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(
                    f"pipeline activations of dtype {node.dtype} cannot be sent; use one of {sorted(_DTYPES)}"
                )
            return {"t": len(tensors) - 1, "shape": list(node.shape), "dtype": dtype, "grad": node.requires_grad}
        if isinstance(node, tuple):
            return {"tuple": [walk(x) for x in node]}
        if isinstance(node, list):
            return {"list": [walk(x) for x in node]}
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise TypeError(f"pipeline activations: dict keys must be strings; got {list(node)}")
            return {"dict": [[k, walk(v)] for k, v in node.items()]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"c": node}
        raise TypeError(
            f"pipeline activations may be tensors, tuples, lists, dicts and constants; got {type(node).__name__}"
        )

    return walk(tree), tensors


def unflatten(spec: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in spec:
        return tensors[spec["t"]]
    if "tuple" in spec:
        return tuple(unflatten(x, tensors) for x in spec["tuple"])
    if "list" in spec:
        return [unflatten(x, tensors) for x in spec["list"]]
    if "dict" in spec:
        return {k: unflatten(v, tensors) for k, v in spec["dict"]}
    return spec["c"]


def tensor_specs(spec: Any) -> list[dict[str, Any]]:
    """The tensor slots of a description, in order."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if "t" in node:
            found.append(node)
        for key in ("tuple", "list"):
            for child in node.get(key, []):
                walk(child)
        for _, child in node.get("dict", []):
            walk(child)

    walk(spec)
    return sorted(found, key=lambda s: s["t"])


class Exchanger:
    """Sends and receives pytrees between pipeline stages for one engine (keeps pending sends until `flush`)."""

    def __init__(self, *, num_virtual: int, dynamic: bool, device: torch.device) -> None:
        self.num_virtual, self.dynamic, self.device = num_virtual, dynamic, device
        self._pending: list[tuple[p2p.PendingSend, Any]] = []
        self._sent_specs: dict[tuple[int, str], str] = {}
        self._recv_specs: dict[tuple[int, str], Any] = {}

    def _tag(self, direction: str, stage: int, micro: int, part: int) -> int:
        if micro >= _MICROS:
            raise ValueError(f"a pipeline batch has at most {_MICROS} micro-batches; got micro-batch {micro}")
        kind = 0 if direction == "act" else 1
        return (((kind * self.num_virtual + stage) * _MICROS + micro) * _PARTS) + part

    def send(self, tree: object, *, dst: int, direction: str, stage: int, micro: int, what: str) -> None:
        spec, tensors = flatten(tree)
        if len(tensors) + 2 > _PARTS:
            raise ValueError(f"a pipeline activation has {len(tensors)} tensors; at most {_PARTS - 2} are supported")
        text = json.dumps(spec)
        parts: list[torch.Tensor] = []
        if self.dynamic or self._sent_specs.get((stage, direction)) != text:
            payload = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(self.device)
            parts += [torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), payload]
            self._sent_specs[(stage, direction)] = text
        else:
            parts += [torch.zeros(1, dtype=torch.int64, device=self.device)]  # 0: same description as before
        parts += [t.detach().contiguous() for t in tensors]
        for index, tensor in enumerate(parts):
            work = p2p.send(tensor, dst, tag=self._tag(direction, stage, micro, index), what=what)
            self._pending.append((work, tensor))

    def recv(self, *, src: int, direction: str, stage: int, micro: int, what: str) -> Any:
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        p2p.recv(header, src, tag=self._tag(direction, stage, micro, 0), what=what)
        index = 1
        if int(header[0]) > 0:
            payload = torch.empty(int(header[0]), dtype=torch.uint8, device=self.device)
            p2p.recv(payload, src, tag=self._tag(direction, stage, micro, 1), what=what)
            spec = json.loads(bytes(payload.cpu().tolist()).decode())
            self._recv_specs[(stage, direction)] = spec
            index = 2
        else:
            spec = self._recv_specs[(stage, direction)]
        tensors = []
        for slot in tensor_specs(spec):
            tensor = torch.empty(slot["shape"], dtype=_DTYPES[slot["dtype"]], device=self.device)
            p2p.recv(tensor, src, tag=self._tag(direction, stage, micro, index), what=what)
            index += 1
            tensors.append(tensor.requires_grad_(bool(slot["grad"]) and tensor.is_floating_point()))
        return unflatten(spec, tensors)

    def flush(self) -> None:
        """Wait for every pending send (each within the collective timeout)."""
        pending, self._pending = self._pending, []
        for work, _tensor in pending:
            work.wait()
