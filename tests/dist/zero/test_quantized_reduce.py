"""ZeRO++ qgZ's reduce-scatter (zero/stage3/quantized_reduce.py) against its definition, bit for bit: each
rank's pieces for other ranks quantized block-wise (int4 inside a node, int8 across; written out here in plain
torch: clamp(round(x / s)) x s with s = the block's absmax / 7.5 or / 127.5, codes -8..7 or -128..127), its piece
for itself exact, dequantized and summed in fp32 in sender order, node by node, then across nodes. At 2 ranks
(one node) and at 4 ranks as 2 nodes x 2 (LOCAL_WORLD_SIZE=2, set in the rank before any group is built), 4 nodes
of 1 and one node of 4; fp32 and bf16 staging; widths with a partial last block. The bytes of each exchange are
counted per phase (the site that issued them)."""

from __future__ import annotations

import functools
import os

import torch

from tests.harness import run_distributed

WIDTHS = (300, 1024)
DTYPES = (torch.float32, torch.bfloat16)
LAYOUTS = {2: (None,), 4: ("2", "1", None)}  # LOCAL_WORLD_SIZE per case (None: unset, one node)
BLOCK = 256


def staging_of(rank: int, world: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s rank-major staging rows: magnitudes that vary by block, one all-zero stretch."""
    gen = torch.Generator().manual_seed(1000 * width + rank)
    values = torch.randn(world * width, generator=gen)
    values *= torch.logspace(-3, 1, values.numel() // 97 + 1).repeat_interleave(97)[: values.numel()]
    values[width // 2 : width // 2 + BLOCK] = 0.0
    return values.to(dtype)


def reduce_case(rank: int, world: int) -> dict:
    from slipstream.comm import count_collectives
    from slipstream.zero.stage3.pool import BufferPool
    from slipstream.zero.stage3.quantized_reduce import QuantizedReduceScatter, node_levels

    out: dict = {}
    for local in LAYOUTS[world]:
        if local is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = local
        reducer = QuantizedReduceScatter(node_levels(None), BufferPool(torch.device("cpu")))
        for width in WIDTHS:
            for dtype in DTYPES:
                receive = torch.full((width,), float("nan"), dtype=dtype)
                sites: dict[str, int] = {}
                with count_collectives() as counter:
                    counter.listener = functools.partial(_by_function, sites)
                    reducer.launch(receive, staging_of(rank, world, width, dtype)).wait()
                out[(local, width, str(dtype))] = (receive, sites)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    return out


def _by_function(sites: dict[str, int], op: str, size: int, site: str) -> None:
    sites[site.split("(")[-1]] = size  # "slipstream/...py:LINE (function)" -> "function)"


def _dequantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """dequantize(quantize(x)) by the definition: blocks of 256 (zero-padded), s = absmax / (2^(bits-1) - 1/2),
    codes clamped to [-2^(bits-1), 2^(bits-1) - 1]."""
    levels, top = 2.0 ** (bits - 1) - 0.5, 2.0 ** (bits - 1)
    flat = torch.zeros(-(-x.numel() // BLOCK) * BLOCK)
    flat[: x.numel()] = x.reshape(-1).float()
    blocks = flat.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1, keepdim=True) / levels
    codes = (blocks / torch.where(scales > 0, scales, torch.ones_like(scales))).round().clamp(-top, top - 1)
    return (codes * scales).reshape(-1)[: x.numel()].view(x.shape)


def _sent(x: torch.Tensor, bits: int, own: bool) -> torch.Tensor:
    """What a piece adds to the sum: its exact values when the rank sends it to itself, else dequantized."""
    return x if own else _dequantized(x, bits)


def _in_order_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total += piece
    return total


def expected(world: int, local: int, width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's result by the definition (see the module docstring)."""
    nodes = world // local
    rows = [staging_of(r, world, width, dtype).float().view(nodes, local, width) for r in range(world)]
    # phase 1: node m's sum of the pieces bound for its member l, [nodes, width] (rows (m', l) of every node m')
    inner = {
        (m, pos): (
            _in_order_sum([_sent(rows[m * local + src][:, pos], 4, src == pos) for src in range(local)])
            if local > 1
            else rows[m * local][:, pos]
        )
        for m in range(nodes)
        for pos in range(local)
    }
    out = []
    for rank in range(world):
        m, pos = divmod(rank, local)
        pieces = [inner[(src, pos)][m] for src in range(nodes)]
        total = _in_order_sum([_sent(p, 8, src == m) for src, p in enumerate(pieces)]) if nodes > 1 else pieces[0]
        out.append(total.to(dtype))
    return out


def _padded_bytes(numel: int, bits: int) -> int:
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK * bits // 8 + 4 * blocks


def _check(world: int, results: list[dict]) -> None:
    for local in LAYOUTS[world]:
        per_node = world if local is None else int(local)
        nodes = world // per_node
        for width in WIDTHS:
            for dtype in DTYPES:
                want = expected(world, per_node, width, dtype)
                for rank, result in enumerate(results):
                    got, sites = result[(local, width, str(dtype))]
                    case = f"rank {rank}, LOCAL_WORLD_SIZE={local}, width {width}, {dtype}"
                    assert torch.equal(got, want[rank]), f"{case}: {(got.float() - want[rank].float()).abs().max()}"
                    counted = {}
                    if per_node > 1:
                        counted["_within_node)"] = per_node * _padded_bytes(nodes * width, 4)
                    if nodes > 1:
                        counted["_across_nodes)"] = nodes * _padded_bytes(width, 8)
                    assert sites == counted, f"{case}: all-to-all bytes per phase {sites}, want {counted}"


def test_quantized_reduce_equals_its_definition_at_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _check(2, run_distributed(reduce_case, world_size=2, tmp_dir=tmp_path))


def test_quantized_reduce_equals_its_definition_at_four_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _check(4, run_distributed(reduce_case, world_size=4, tmp_dir=tmp_path))
