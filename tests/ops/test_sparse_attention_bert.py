"""SparseAttentionUtils and BertSparseSelfAttention on tiny Transformers BERT and RoBERTa models built offline:
padding to the block size and back, the position table grown by repetition, and self-attention replaced by
sparse self-attention (a dense layout gives the original model's outputs; a Fixed layout gives dense attention
masked with the layout)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.ops.sparse_attention import (
    BertSparseSelfAttention,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
)
from slipstream.ops.sparse_attention.bert_sparse_self_attention import HFBertSparseSelfAttention

transformers = pytest.importorskip("transformers")

BLOCK, HEADS, HIDDEN, VOCAB, PAD = 4, 2, 16, 40, 0


def _bert(kind: str = "bert", attn: str = "eager") -> nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=32,
        pad_token_id=PAD if kind == "bert" else 1,
        attn_implementation=attn,
    )
    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=24, **common)
        return transformers.BertForMaskedLM(config).eval()
    config = transformers.RobertaConfig(max_position_embeddings=14, **common)  # 12 positions + 2 reserved rows
    return transformers.RobertaForMaskedLM(config).eval()


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, seq - 3 :] = 0  # the first sequence is 3 tokens shorter
    return ids.masked_fill(mask == 0, PAD), mask


def test_pad_to_block_size_and_unpad() -> None:
    ids, mask = _batch(13)
    types, positions = torch.ones_like(ids), torch.arange(13).expand(2, -1)
    embeds = torch.randn(2, 13, HIDDEN)
    table = nn.Embedding(VOCAB, HIDDEN)
    pad_len, *padded = SparseAttentionUtils.pad_to_block_size(BLOCK, ids, mask, types, positions, embeds, PAD, table)
    assert pad_len == 3
    p_ids, p_mask, p_types, p_positions, p_embeds = padded
    for name, got, original, fill in (
        ("input_ids", p_ids, ids, PAD),
        ("attention_mask", p_mask, mask, 0),
        ("token_type_ids", p_types, types, 0),
        ("position_ids", p_positions, positions, PAD),
    ):
        assert got.shape == (2, 16) and torch.equal(got[:, :13], original), name
        assert bool((got[:, 13:] == fill).all()), name
    assert torch.equal(p_embeds[:, :13], embeds)
    assert torch.equal(p_embeds[:, 13:], table(torch.full((2, 3), PAD)))
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad_len, p_embeds), embeds)
    # a multiple of the block is left as it is; None stays None; inputs_embeds alone set the length
    short = ids[:, :12]
    same = SparseAttentionUtils.pad_to_block_size(BLOCK, short, None, None, None, None, PAD, None)
    assert same[0] == 0 and same[1] is short and same[2:] == (None, None, None, None)
    pad_len, *rest = SparseAttentionUtils.pad_to_block_size(BLOCK, None, None, None, None, embeds, PAD, table)
    assert pad_len == 3 and rest[:4] == [None, None, None, None] and rest[4].shape == (2, 16, HIDDEN)
    assert SparseAttentionUtils.unpad_sequence_output(0, embeds) is embeds


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_extend_position_embedding_repeats_the_table(kind: str) -> None:
    model = _bert(kind)
    inner = getattr(model, kind)
    reserved = 2 if kind == "roberta" else 0
    original = inner.embeddings.position_embeddings.weight.detach().clone()
    positions = original.shape[0] - reserved
    weight = inner.embeddings.position_embeddings.weight
    SparseAttentionUtils.extend_position_embedding(model, 2 * positions)
    grown = inner.embeddings.position_embeddings.weight
    assert grown is weight and grown.shape == (2 * positions + reserved, HIDDEN)  # the same parameter, as DeepSpeed
    assert torch.equal(grown[:reserved], original[:reserved])
    assert torch.equal(grown[reserved:], original[reserved:].repeat(2, 1))
    assert model.config.max_position_embeddings == 2 * positions + reserved
    assert inner.embeddings.position_ids.shape == (1, 2 * positions + reserved)
    ids, mask = _batch(2 * positions - 4)  # longer than the original table: runs with the grown buffers
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (2, 2 * positions - 4, VOCAB)
    with pytest.raises(ValueError, match=r"max_position 10 does not exceed the model's \d+ positions"):
        SparseAttentionUtils.extend_position_embedding(model, 10)
    with pytest.raises(ValueError, match="neither a BERT nor a RoBERTa model"):
        SparseAttentionUtils.extend_position_embedding(nn.Linear(2, 2), 64)


@pytest.mark.parametrize("kind, attn", [("bert", "eager"), ("bert", "sdpa"), ("roberta", "eager")])
def test_dense_layout_gives_the_original_outputs(kind: str, attn: str) -> None:
    original = _bert(kind, attn)
    model = copy.deepcopy(original)
    target = getattr(model, kind) if attn == "sdpa" else model  # a BertModel itself, or a task model holding one
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        target, 12, DenseSparsityConfig(num_heads=HEADS, block=BLOCK)
    )
    layers = getattr(model, kind).encoder.layer
    assert all(isinstance(layer.attention.self, HFBertSparseSelfAttention) for layer in layers)
    assert layers[0].attention.self.query is getattr(model, kind).encoder.layer[0].attention.self.query
    assert model.config.max_position_embeddings == (14 if kind == "roberta" else 12)
    ids, mask = _batch(11)  # padded to 12 with pad tokens, masked out, then cut back
    pad_len, p_ids, p_mask, *_ = SparseAttentionUtils.pad_to_block_size(BLOCK, ids, mask, None, None, None, PAD, None)
    hidden = getattr(model, kind)(input_ids=p_ids, attention_mask=p_mask).last_hidden_state
    expected = getattr(original, kind)(input_ids=ids, attention_mask=mask).last_hidden_state
    got = SparseAttentionUtils.unpad_sequence_output(pad_len, hidden)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


class _DenseLayoutAttention(nn.Module):
    """Reference: dense attention of a Transformers self-attention module's projections, -inf outside the layout
    and the padding mask added."""

    def __init__(self, attention: nn.Module, layout: torch.Tensor) -> None:
        super().__init__()
        self.attention, self.layout = attention, layout

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, **_: object) -> tuple:
        batch, seq, _ = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(batch, seq, HEADS, -1).transpose(1, 2)
            for proj in (self.attention.query, self.attention.key, self.attention.value)
        )
        keep = self.layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()[:, :seq, :seq]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + attention_mask
        context = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
        return context.transpose(1, 2).reshape(batch, seq, -1), None


def test_fixed_layout_equals_dense_attention_with_the_layout_mask() -> None:
    config = FixedSparsityConfig(
        num_heads=HEADS,
        block=BLOCK,
        num_local_blocks=2,
        different_layout_per_head=True,
        num_different_global_patterns=2,
    )
    original = _bert("bert", "eager")
    reference = copy.deepcopy(original)
    layout = config.make_layout(16)
    for layer in reference.bert.encoder.layer:
        layer.attention.self = _DenseLayoutAttention(layer.attention.self, layout)
    model = copy.deepcopy(original)
    SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
        model.config, model.bert.encoder.layer, config
    )
    ids, mask = _batch(16)
    got = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = reference.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    plain = original.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (got - plain).abs().max() > 1e-3  # the layout does change the result


def test_bert_sparse_self_attention_called_as_in_deepspeed() -> None:
    """DeepSpeed's call: forward(hidden_states, attention_mask) with the extended mask [batch, 1, 1, seq],
    returning the context; a mask that differs between queries, cross-attention and bad sizes are refused."""
    config = transformers.BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS)
    layer = BertSparseSelfAttention(config, DenseSparsityConfig(num_heads=HEADS, block=BLOCK))
    hidden = torch.randn(2, 8, HIDDEN)
    extended = torch.zeros(2, 1, 1, 8)
    extended[0, ..., 6:] = -10000.0
    out = layer(hidden, extended)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 8, HIDDEN)
    q, k, v = (layer.transpose_for_scores(p(hidden)) for p in (layer.query, layer.key, layer.value))
    probs = torch.softmax((q @ k.transpose(-1, -2)) * (HIDDEN // HEADS) ** -0.5 + extended, -1)
    torch.testing.assert_close(out, (probs @ v).transpose(1, 2).reshape(2, 8, HIDDEN), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="differs between queries or heads"):
        layer(hidden, torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8))
    with pytest.raises(NotImplementedError, match="cross-attention"):
        layer(hidden, extended, encoder_hidden_states=hidden)
    with pytest.raises(ValueError, match="hidden_size 10 is not a multiple of num_attention_heads 4"):
        BertSparseSelfAttention(transformers.BertConfig(hidden_size=10, num_attention_heads=4))


def test_update_tokenizer_model_max_length(tmp_path: object) -> None:
    from pathlib import Path

    vocab = Path(str(tmp_path)) / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    tokenizer = transformers.BertTokenizer(vocab_file=str(vocab), model_max_length=24)
    assert SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 96) is tokenizer
    assert tokenizer.model_max_length == 96 and tokenizer.init_kwargs["model_max_length"] == 96
