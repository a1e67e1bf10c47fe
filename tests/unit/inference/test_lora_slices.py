"""LoRA fused into slices of an inference copy (inference/lora.py `SliceFusion`), without processes.

Each rank's slice of a DeepSpeed-Chat-shaped LoRA layer's base weight (rows, columns, or whole) gets the slice of
the weight the in-place fuse gives (within 1e-6), whichever order the refill reads the base weight and the factors in,
also when the chunk that held the factors is freed before the base weight comes (its values are kept). The
training layer is not touched. The stand-in of a LoRA layer is a plain linear of the base weight's shape.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.inference.lora import FusedSlice, SliceFusion, fuse_lora, linear_stand_in
from tests.dist.inference.test_hybrid_lora import LoraLinear


def _layer() -> LoraLinear:
    torch.manual_seed(0)
    return LoraLinear(nn.Linear(6, 8))


def _fused_weight(layer: LoraLinear) -> torch.Tensor:
    twin = LoraLinear(nn.Linear(6, 8))
    twin.load_state_dict(layer.state_dict())
    twin.lora_scaling = layer.lora_scaling
    fuse_lora([twin])
    return twin.weight.detach().clone()


def _refill(
    layer: LoraLinear, dim: int | None, start: int, width: int, chunks: list[list[nn.Parameter]]
) -> torch.Tensor:
    """The slice as a refill reading `chunks` in order builds it; each chunk's values are wiped after it (freed)."""
    weight = layer.weight.detach()
    base = weight if dim is None else weight.narrow(dim, start, width)
    target = torch.empty_like(base)
    fusion = SliceFusion([FusedSlice(layer, "layer", layer.weight, target, dim, start)])
    factors = set() if layer.fuse_lora else {id(layer.lora_left_weight), id(layer.lora_right_weight)}
    assert {id(p) for p in fusion.parameters()} == factors
    saved = {id(p): p.detach().clone() for p in layer.parameters()}
    for chunk in chunks:
        for param in chunk:
            param.data.copy_(saved[id(param)])
            if param is layer.weight:
                target.copy_(base)
        fusion.add_ready(chunk)
        for param in chunk:
            param.data.zero_()  # the chunk is released: its values are gone
    fusion.finish()
    for param in layer.parameters():
        param.data.copy_(saved[id(param)])
    return target


def test_each_slice_gets_the_in_place_fuse_in_any_read_order() -> None:
    layer = _layer()
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    whole = _fused_weight(layer)
    factors = [layer.lora_left_weight, layer.lora_right_weight]
    orders = {
        "one chunk": [[layer.weight, *factors]],
        "factors first, freed before the base weight": [factors, [layer.weight]],
        "base weight first": [[layer.weight], factors],
        "split factors": [[layer.lora_left_weight], [layer.weight], [layer.lora_right_weight]],
    }
    for what, chunks in orders.items():
        for dim, start, width in ((0, 4, 4), (1, 0, 3), (1, 3, 3), (None, 0, 0)):
            got = _refill(layer, dim, start, width, chunks)
            expected = whole if dim is None else whole.narrow(dim, start, width)
            # the same products over r as the whole matmul's (bit-equal here; another BLAS may round a kernel
            # for a narrower matrix differently)
            assert (got - expected).abs().max() <= 1e-6, (what, dim, start, got - expected)
            base = before["weight"] if dim is None else before["weight"].narrow(dim, start, width)
            assert not torch.equal(got, base), (what, dim, "no delta added")
    assert all(torch.equal(p, before[name]) for name, p in layer.named_parameters()), "the training layer changed"
    assert not layer.fuse_lora


def test_a_fused_layer_gets_no_delta_again() -> None:
    layer = _layer()
    fuse_lora([layer])
    got = _refill(layer, 0, 0, 4, [[layer.weight, layer.lora_left_weight, layer.lora_right_weight]])
    assert torch.equal(got, layer.weight.detach()[:4])


def test_the_stand_in_is_a_plain_linear_of_the_base_weight() -> None:
    layer = _layer()
    made: list[nn.Parameter] = []

    def placeholder(param: nn.Parameter) -> nn.Parameter:
        made.append(nn.Parameter(torch.empty(param.shape, device="meta"), requires_grad=False))
        return made[-1]

    linear = linear_stand_in(layer, placeholder)
    assert type(linear) is nn.Linear and (linear.out_features, linear.in_features) == (8, 6)
    assert linear.weight is made[0] and linear.bias is made[1] and len(made) == 2
