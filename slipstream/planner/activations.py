"""Activation memory per rank for a decoder-only transformer (an estimate, not a measurement).

Per layer, without activation checkpointing, in 16-bit (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 1 with no tensor parallelism):
    seq * micro_batch * hidden * (34 + 5 * heads * seq / hidden)   bytes
The 5 * heads * seq / hidden term is the attention score/softmax/dropout storage; fused attention kernels
(flash / memory-efficient SDPA) do not keep it: `fused_attention=True` leaves it out. fp32 activations
double it (the figure scales with the parameter dtype's size over 2).
With activation checkpointing each layer keeps only its input, seq * micro_batch * hidden values, and one
layer's full activations live again during its recomputation.
Both add the output layer: the logits in the parameter dtype plus the fp32 log-softmax cross-entropy keeps,
seq * micro_batch * vocab * (dtype bytes + 4).
"""

from __future__ import annotations

from slipstream.planner.shapes import Dims


def transformer_activations(
    dims: Dims, *, seq: int, micro_batch: int, dtype_bytes: int, checkpointing: bool, fused_attention: bool = False
) -> int:
    """Bytes of activations one rank keeps for backward at the peak (end of forward), for a model of `dims`
    (all but `vocab` needed; no vocab: no output layer)."""
    hidden, layers, heads, vocab = dims.hidden, dims.layers, dims.heads, dims.vocab
    for name, value in (
        ("seq", seq),
        ("micro_batch", micro_batch),
        ("hidden", hidden),
        ("layers", layers),
        ("heads", heads),
    ):
        if value is None or value < 1:
            raise ValueError(f"activations: {name} must be >= 1, got {value}")
    assert hidden and layers and heads  # checked above
    tokens_hidden = seq * micro_batch * hidden
    scale = dtype_bytes / 2
    scores = 0.0 if fused_attention else 5 * heads * seq / hidden
    per_layer = tokens_hidden * (34 + scores) * scale
    logits = seq * micro_batch * (vocab or 0) * (dtype_bytes + 4)
    if not checkpointing:
        return int(layers * per_layer + logits)
    return int(layers * tokens_hidden * dtype_bytes + per_layer + logits)
