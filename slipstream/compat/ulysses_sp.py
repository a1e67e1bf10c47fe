"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: DeepSpeed's Arctic Long Sequence Training (ALST) names.

The pieces live in slipstream/sequence/ (hf.py: the Transformers attention wrapper; data.py: the loader
adapter; tiled.py: tiled MLP, tiled compute and the tiled logits loss); this module adds DeepSpeed's entry
point `UlyssesSPAttentionHF.register_with_transformers`, which also builds the sequence-parallel groups and
returns the mpu (compat/parallel_state_sp.py) to pass to `initialize(mpu=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.compat import parallel_state_sp
from slipstream.sequence import hf
from slipstream.sequence.data import UlyssesSPDataLoaderAdapter
from slipstream.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from slipstream.utils.logging import get_logger

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]


class UlyssesSPAttentionHF(hf.UlyssesSPAttentionHF):
    __doc__ = hf.UlyssesSPAttentionHF.__doc__

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
        *,
        head_chunks: int | None = None,
    ) -> Any:
        """Build the sequence-parallel groups and make Transformers' `core_attn_implementation` run Ulysses over
        them; returns the mpu for `initialize(mpu=...)`, or None when `sequence_parallel_size` is 1.

        `model_name_or_path`: a model (or anything with a `.config`, a PEFT wrapper), or a name/path for
        `AutoConfig.from_pretrained`; its attention shape is read from the config. Call it before the model's
        first forward; the replacement holds for every model of the process using that implementation. Sequence
        lengths may vary and need not divide by the group size; `seq_length` is checked for DeepSpeed's
        contract only. `head_chunks` (Slipstream's own): DistributedAttention's, for less memory per rank."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            get_logger().warning("register_with_transformers: `max_length` is deprecated; use `seq_length`")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: set seq_length_is_variable=True, or seq_length to the fixed sequence "
                "length of every batch"
            )
        config = _config_of(model_name_or_path)
        model_impl = getattr(config, "_attn_implementation", None)
        if model_impl is not None and model_impl != core_attn_implementation:
            raise ValueError(
                f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} does not match "
                f"model config attn_implementation={model_impl!r}; set both to the same value so the "
                "sequence-parallel wrapper replaces the attention the model calls"
            )
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        shape, group = _attention_shape(text), parallel_state_sp.get_sequence_parallel_group()

        def wrap(core: Callable[..., Any]) -> hf.UlyssesSPAttentionHF:
            return cls(core, micro_batch_size, *shape, group, disable_in_eval=disable_in_eval, head_chunks=head_chunks)

        hf.install(core_attn_implementation, wrap)
        return parallel_state_sp


def _attention_shape(text: Any) -> tuple[int, int, int, int]:
    """(attention heads, head size, key/value heads, layers) of a Transformers text config."""
    heads = int(text.num_attention_heads)
    head_size = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return heads, head_size, kv_heads, int(text.num_hidden_layers)


def _config_of(model_name_or_path: Any) -> Any:
    if hasattr(model_name_or_path, "config"):  # a model, or a wrapper (PEFT) exposing its config
        return model_name_or_path.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path)
