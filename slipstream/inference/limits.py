"""The token bound of the hybrid engine's `generate`: `hybrid_engine.max_out_tokens`.

DeepSpeed sizes its inference workspace (the KV cache of every layer) for `max_out_tokens` positions: the
prompt and every generated token must fit. Slipstream's hybrid `generate` keeps the same bound: a call whose
prompt plus the tokens it may generate exceeds it is refused before anything is gathered, naming the key. How
many tokens a call may generate follows Hugging Face's `generate`: `max_new_tokens` (a keyword argument, else
the generation config's) counts from the prompt; without it, `max_length` (keyword, then the generation
config's) is the whole length.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _prompt_tokens(inputs: tuple[object, ...], kwargs: Mapping[str, object]) -> int | None:
    prompt = inputs[0] if inputs else kwargs.get("input_ids", kwargs.get("inputs"))
    return prompt.shape[-1] if isinstance(prompt, torch.Tensor) else None


def _setting(name: str, kwargs: Mapping[str, object], config: object) -> int | None:
    value = kwargs.get(name, getattr(config, name, None))
    return int(value) if isinstance(value, int) else None


def requested_tokens(inputs: tuple[object, ...], kwargs: Mapping[str, object], model_config: object) -> int | None:
    """Prompt plus the most tokens `generate(*inputs, **kwargs)` may produce (None: no token prompt to count).
    `model_config` is the model's `generation_config` (or None); a `generation_config` keyword wins over it."""
    prompt = _prompt_tokens(inputs, kwargs)
    if prompt is None:
        return None
    config = kwargs.get("generation_config", model_config)
    new_tokens = _setting("max_new_tokens", kwargs, config)
    if new_tokens is not None:
        return prompt + new_tokens
    length = _setting("max_length", kwargs, config)
    return max(prompt, length) if length is not None else prompt


def check_max_out_tokens(
    inputs: tuple[object, ...], kwargs: Mapping[str, object], model_config: object, max_out_tokens: int
) -> None:
    """Refuse a call whose prompt plus new tokens exceeds `max_out_tokens` (see the module doc)."""
    total = requested_tokens(inputs, kwargs, model_config)
    if total is not None and total > max_out_tokens:
        raise ValueError(
            f"engine.generate(): the prompt plus the new tokens come to {total} positions, more than "
            f"hybrid_engine.max_out_tokens ({max_out_tokens}); raise hybrid_engine.max_out_tokens to at least "
            f"{total} or ask for fewer tokens (max_new_tokens / max_length)"
        )
