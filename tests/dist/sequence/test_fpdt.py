"""FPDT at 2 ranks (Ulysses across the ranks, chunked attention on each) against single-process attention, in one
spawn: sequence lengths the chunk size does not divide, grouped KV heads, host offload on and off, rotary
embeddings given over the whole sequence. Outputs and input gradients equal the reference rows each rank holds
(FPDT_InputConstruct's layout), the weights' gradients summed over the ranks equal the reference's;
FPDT_LogitsLoss gathers the same per-token losses; a one-layer model built from FPDT_InputConstruct,
FPDT_Attention, FPDT_FFN and FPDT_LogitsLoss has the plain model's masked loss and gradients; inside the engine
at ZeRO 0 and 3 the layer gives the plain model's gradients. Also the all-to-alls one layer issues per step."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed, run_subtests

CASES = [
    {"seq": 14, "chunk": 4, "kv_heads": 2, "offload": True},
    {"seq": 14, "chunk": 4, "kv_heads": 2, "offload": False},
    {"seq": 16, "chunk": 6, "kv_heads": 4, "offload": True, "rotary": True},
]


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def attention_case(
    rank: int, world: int, *, seq: int, chunk: int, kv_heads: int, offload: bool, rotary: bool = False
) -> dict:
    from slipstream.comm import count_collectives
    from slipstream.sequence.fpdt import FPDT_Attention, fpdt_token_order
    from tests.unit.sequence.test_fpdt import _config, attention_reference, attention_weights, rotary_tables

    config = _config(kv_heads=kv_heads)
    weights = attention_weights(config, seed=seq)
    gen = torch.Generator().manual_seed(seq + 1)
    x = torch.randn(seq, 2, 16, generator=gen, dtype=torch.float64)
    upstream = torch.randn(seq, 2, 16, generator=gen, dtype=torch.float64)
    full = x.clone().requires_grad_()
    tables = rotary_tables(seq) if rotary else None  # over the whole sequence, in order (DeepSpeed's)
    expected = attention_reference(full, weights, config, tables)
    (expected * upstream).sum().backward()
    reference_grads = [t.grad.clone() for t in weights]
    for t in weights:
        t.grad = None

    rows = fpdt_token_order(seq, chunk, world)[rank * seq // world : (rank + 1) * seq // world]
    local = x[rows].clone().requires_grad_()
    layer = FPDT_Attention(config, *weights, None, return_bias=False, chunk_size=chunk)
    with count_collectives() as counter:
        out, _ = layer(local, None, None, tables, cpu_offloading=offload)
        (out * upstream[rows]).sum().backward()
    torch.testing.assert_close(out, expected[rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(local.grad, full.grad[rows], rtol=1e-10, atol=1e-10)
    for name, t, ref in zip(["w1", "b1", "w2", "b2"], weights, reference_grads):
        torch.testing.assert_close(_sum_over_ranks(t.grad), ref, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")
    assert (layer.host_store.stats.offloaded > 0) == offload
    return {"chunks": math.ceil(seq / chunk), **counter.calls}


def logits_loss_case(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from slipstream.sequence.fpdt import FPDT_LogitsLoss, fpdt_token_order

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(14, 2, 16, generator=gen, dtype=torch.float64)
    head = torch.randn(10, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (2, 14), generator=gen)
    upstream = torch.rand(14, 2, generator=gen)  # a different weight per gathered row
    order = fpdt_token_order(14, 4, world)
    full = x.clone().requires_grad_()
    logits = (full @ head.t()).float()  # as the LM head computes them
    expected = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(14, 2)
    (expected[order] * upstream).sum().backward()
    reference_head_grad, head.grad = head.grad.clone(), None
    rows = order[rank * 7 : (rank + 1) * 7]
    local = x[rows].clone().requires_grad_()
    losses = FPDT_LogitsLoss.apply(local, labels[:, rows], head, rank, world, None, 3)
    torch.testing.assert_close(losses, expected[order])  # gathered in rank order
    (losses * upstream).sum().backward()
    torch.testing.assert_close(local.grad, full.grad[rows])
    torch.testing.assert_close(_sum_over_ranks(head.grad), reference_head_grad)
    return {}


def _block_loss(
    params: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor, fpdt_mask: torch.Tensor, fpdt: dict
) -> torch.Tensor:
    """Embedding, attention + residual, GeLU MLP + residual, LM head: the masked mean token loss, plain (`fpdt`
    empty) or with the FPDT classes on this rank's tokens (`fpdt`: rank, world)."""
    import torch.nn.functional as F

    from slipstream.sequence.fpdt import FPDT_FFN, FPDT_Attention, FPDT_LogitsLoss
    from tests.unit.sequence.test_fpdt import _config, attention_reference, rotary_tables

    config, attention = _config(), [params[n] for n in ("qkv", "qkv_bias", "dense", "dense_bias")]
    mlp = [params[n] for n in ("w1", "b1", "w2", "b2")]
    h = params["embed"][tokens].transpose(0, 1)
    if not fpdt:
        h = h + attention_reference(h, attention, config, rotary_tables(h.shape[0]))
        h = h + F.linear(F.gelu(F.linear(h, *mlp[:2]), approximate="tanh"), *mlp[2:])
        logits = (h @ params["head"].t()).float()
        losses = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(h.shape[:2])
        return (losses * fpdt_mask.t()).sum() / fpdt_mask.sum()
    layer = FPDT_Attention(config, *attention, None, return_bias=False, chunk_size=4)
    h = h + layer(h, None, None, rotary_tables(h.shape[0] * fpdt["world"]))[0]
    out, bias = FPDT_FFN.apply(h, *mlp, False, 3)
    h = h + out + bias
    losses = FPDT_LogitsLoss.apply(h, labels, params["head"], fpdt["rank"], fpdt["world"], None, 2)
    return (losses * fpdt_mask.t()).sum() / fpdt_mask.sum()


def block_case(rank: int, world: int) -> dict:
    """A training step of a one-layer model: the same loss and, summed over the ranks, the same gradients."""
    import types

    from slipstream.sequence.fpdt import FPDT_InputConstruct

    gen = torch.Generator().manual_seed(7)
    shapes = {"embed": (10, 16), "qkv": (32, 16), "qkv_bias": (32,), "dense": (16, 16), "dense_bias": (16,)}
    shapes.update({"w1": (24, 16), "b1": (24,), "w2": (16, 24), "b2": (16,), "head": (10, 16)})
    params = {n: (torch.randn(s, generator=gen, dtype=torch.float64) * 0.3).requires_grad_() for n, s in shapes.items()}
    tokens, labels = (torch.randint(0, 10, (2, 14), generator=gen) for _ in range(2))
    loss_mask = (torch.rand(2, 14, generator=gen) < 0.7).double()
    expected = _block_loss(params, tokens, labels, loss_mask, {})
    expected.backward()
    reference = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    args = types.SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=4)
    local, local_labels, mask, _, _ = FPDT_InputConstruct(
        tokens, labels, loss_mask, None, None, args, world, rank
    ).generate()
    loss = _block_loss(params, local, local_labels, mask, {"rank": rank, "world": world})
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)  # fp32 logits on both sides
    for name, p in params.items():
        torch.testing.assert_close(_sum_over_ranks(p.grad), reference[name], rtol=1e-6, atol=1e-6, msg=name)
    return {}


SEQ, WIDTH, VOCAB = 11, 16, 10


class ZeroModel(nn.Module):
    """Attention (FPDT's, or plain causal attention of the same weights) + residual, then an LM head and loss."""

    def __init__(self, group: Any = None, *, fpdt: bool) -> None:
        from slipstream.sequence.fpdt import FPDT_Attention
        from tests.unit.sequence.test_fpdt import _config

        super().__init__()
        torch.manual_seed(0)
        self.config = _config()
        self.qkv, self.dense = nn.Linear(WIDTH, 32), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.attn = None
        if fpdt:
            weights = (self.qkv.weight, self.qkv.bias, self.dense.weight, self.dense.bias)
            self.attn = FPDT_Attention(self.config, *weights, group, return_bias=False, chunk_size=4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from tests.unit.sequence.test_fpdt import attention_reference

        h = x.transpose(0, 1)  # [seq, batch, hidden]
        if self.attn is None:
            weights = [self.qkv.weight, self.qkv.bias, self.dense.weight, self.dense.bias]
            h = h + attention_reference(h, weights, self.config)
        else:
            h = h + self.attn(h, None)[0]
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.t().flatten())


def _zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return torch.randn(2, SEQ, WIDTH, generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def zero_case(rank: int, world: int) -> dict:
    """FPDT_Attention (host offload on) inside the engine at ZeRO 0 and 3 (the ranks data-parallel with the same
    batch, a sequence-parallel group of one rank each): the loss and the averaged gradients the step will use
    equal the plain model's. The layer holds its weights as the shared parameters of two `nn.Linear` modules, as
    Megatron-style callers pass them, so at ZeRO-3 they are gathered for its forward and again for its backward."""
    import torch.distributed as dist

    from slipstream.compat.param_access import safe_get_full_grad
    from tests.harness.engine_step import zero_sgd_step

    own = [dist.new_group([r]) for r in range(world)][rank]
    x, y = _zero_data()
    plain = ZeroModel(fpdt=False)
    expected_loss = plain(x, y)
    expected_loss.backward()
    for stage in (0, 3):
        model = ZeroModel(own, fpdt=True)
        engine, loss = zero_sgd_step(model, x, y, stage=stage)
        assert model.attn is not None and model.attn.host_store.stats.offloaded > 0
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
        for name, p in engine.module.named_parameters():
            want = plain.get_parameter(name).grad
            torch.testing.assert_close(safe_get_full_grad(p), want, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")
        engine.destroy()
    return {}


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: attention_case(rank, world, **case)) + [
        logits_loss_case(rank, world),
        block_case(rank, world),
        zero_case(rank, world),
    ]


def test_fpdt_at_two_ranks_equals_single_process_attention() -> None:
    counts = run_distributed(grid, world_size=2)[0]
    for got in counts[: len(CASES)]:
        # per chunk: q, k, v and the output forward; the output gradient, dq, dk and dv backward
        assert got == {"chunks": got["chunks"], "all_to_all": 8 * got["chunks"]}
