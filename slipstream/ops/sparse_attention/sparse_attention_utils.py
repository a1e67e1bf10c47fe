"""DeepSpeed's `SparseAttentionUtils`: putting sparse self-attention into a BERT or RoBERTa model (Transformers'
`BertModel` / `RobertaModel`, or a task model holding one as `.bert` / `.roberta`).

- `extend_position_embedding(model, max_position)`: the position table grows to `max_position` rows by repeating
  the original rows (RoBERTa: its two reserved rows stay first and the rows after them repeat), as DeepSpeed
  does; the embeddings' `position_ids` / `token_type_ids` buffers grow with it so longer inputs run.
- `replace_model_self_attention_with_sparse_self_attention` / `replace_self_attention_layer_with_sparse_self_attention_layer`:
  each layer's `attention.self` becomes a `BertSparseSelfAttention` sharing its query, key and value projections
  (`HFBertSparseSelfAttention` in a Transformers model, whose attention block unpacks (context, weights)).
- `pad_to_block_size` / `unpad_sequence_output`: the inputs padded on the sequence dimension to a multiple of
  the block size (pad tokens, masked out), and the encoder output cut back.
- `update_tokenizer_model_max_length`: the tokenizer's `model_max_length`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from slipstream.ops.sparse_attention.bert_sparse_self_attention import (
    BertConfigLike,
    BertSparseSelfAttention,
    HFBertSparseSelfAttention,
)
from slipstream.ops.sparse_attention.layouts import SparsityConfig

__all__ = ["SparseAttentionUtils"]

logger = logging.getLogger(__name__)

_RESERVED = {"bert": 0, "roberta": 2}  # leading position rows that are not positions (RoBERTa's padding offset)


def _encoder_model(model: nn.Module, what: str) -> tuple[str, nn.Module]:
    """("bert" or "roberta", the model that holds `embeddings` and `encoder`)."""
    for kind in _RESERVED:
        inner = getattr(model, kind, None)
        if isinstance(inner, nn.Module):
            return kind, inner
    model_type = str(getattr(getattr(model, "config", None), "model_type", None))
    if model_type in _RESERVED and hasattr(model, "embeddings"):  # a BertModel / RobertaModel itself
        return model_type, model
    raise ValueError(
        f"{what}: {type(model).__name__} is neither a BERT nor a RoBERTa model (no `.bert` / `.roberta`, and "
        f"config.model_type is {model_type}); only those two are supported, as in DeepSpeed"
    )


def _repeated_rows(table: torch.Tensor, reserved: int, rows: int) -> torch.Tensor:
    """`rows` positions: the reserved rows, then the original positions repeated and cut to fit."""
    positions = table[reserved:]
    repeats = -(-rows // positions.shape[0])
    return torch.cat([table[:reserved], positions.repeat(repeats, 1)[:rows]])


def _grow_position_buffers(embeddings: nn.Module, size: int) -> None:
    """Transformers' embeddings keep position_ids and token_type_ids buffers as long as the table."""
    for name in ("position_ids", "token_type_ids"):
        buffer = getattr(embeddings, name, None)
        if isinstance(buffer, torch.Tensor) and buffer.dim() == 2:
            grown = torch.arange(size, device=buffer.device) if name == "position_ids" else buffer.new_zeros(size)
            setattr(embeddings, name, grown.to(buffer.dtype).expand(1, -1))


class SparseAttentionUtils:
    """Static helpers that adapt a pretrained BERT / RoBERTa model to sparse self-attention (module doc)."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grows the position table to `max_position` positions (RoBERTa: plus its two reserved rows) by
        repeating the original ones, and sets `config.max_position_embeddings`."""
        kind, inner = _encoder_model(model, "extend_position_embedding")
        table = cast(nn.Embedding, inner.get_submodule("embeddings.position_embeddings"))
        reserved = _RESERVED[kind]
        original = table.weight.shape[0] - reserved
        if max_position <= original:
            raise ValueError(
                f"extend_position_embedding: max_position {max_position} does not exceed the model's {original} "
                "positions; pass a larger max_position"
            )
        with torch.no_grad():
            table.weight.data = _repeated_rows(table.weight, reserved, max_position)
        table.num_embeddings = max_position + reserved
        _grow_position_buffers(inner.get_submodule("embeddings"), max_position + reserved)
        model.config.max_position_embeddings = max_position + reserved  # type: ignore[union-attr]
        logger.info("extended position embeddings from %d to %d positions", original, max_position)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: object, max_position: int) -> object:
        """Sets the tokenizer's `model_max_length` (and the value it saves) to `max_position`."""
        tokenizer.model_max_length = max_position  # type: ignore[attr-defined]
        tokenizer.init_kwargs["model_max_length"] = max_position  # type: ignore[attr-defined]
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: nn.Module, max_position: int, sparsity_config: SparsityConfig | None = None
    ) -> nn.Module:
        """Every encoder layer's self-attention becomes sparse; `config.max_position_embeddings` is set to
        `max_position` (RoBERTa: plus 2), as DeepSpeed does."""
        kind, inner = _encoder_model(model, "replace_model_self_attention_with_sparse_self_attention")
        config = cast(BertConfigLike, model.config)
        config.max_position_embeddings = max_position + _RESERVED[kind]  # type: ignore[attr-defined]
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            config, inner.get_submodule("encoder.layer").children(), sparsity_config
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config: BertConfigLike, layers: Iterable[nn.Module], sparsity_config: SparsityConfig | None = None
    ) -> Iterable[nn.Module]:
        """Each layer's `attention.self` becomes sparse self-attention sharing its query, key and value
        projections (`sparsity_config` defaults to DeepSpeed's `SparsityConfig(num_heads=4)`, which has no
        layout: pass one)."""
        layouts = sparsity_config if sparsity_config is not None else SparsityConfig(num_heads=4)
        for layer in layers:
            attention = layer.get_submodule("attention")
            dense = attention.get_submodule("self")
            from_transformers = type(dense).__module__.startswith("transformers.")
            sparse = (HFBertSparseSelfAttention if from_transformers else BertSparseSelfAttention)(config, layouts)
            for name in ("query", "key", "value"):
                setattr(sparse, name, dense.get_submodule(name))
            attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        pad_token_id: int,
        model_embeddings: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[
        int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
    ]:
        """(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) padded at the end
        of the sequence to a multiple of `block_size`: ids and position ids with `pad_token_id`, the attention
        mask with 0, token types with 0, embeddings with `model_embeddings(pad ids)`. None stays None."""
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size: give input_ids or inputs_embeds (both are None)")
        batch, seq = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]  # type: ignore[union-attr]
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("pad_to_block_size: inputs_embeds need model_embeddings to embed the pad tokens")
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)

        def pad(x: torch.Tensor | None, value: int) -> torch.Tensor | None:
            return None if x is None else F.pad(x, (0, pad_len), value=value)

        return (
            pad_len,
            pad(input_ids, pad_token_id),
            pad(attention_mask, 0),
            pad(token_type_ids, 0),
            pad(position_ids, pad_token_id),
            inputs_embeds,
        )

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """The encoder output [batch, seq, ...] without the `pad_len` positions padding added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
