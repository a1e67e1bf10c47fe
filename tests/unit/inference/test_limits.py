"""`hybrid_engine.max_out_tokens`: the prompt plus the tokens a generate call may produce, counted as Hugging
Face's generate counts them (max_new_tokens over max_length, keyword arguments over the generation config), and
a call beyond the bound refused by name."""

from __future__ import annotations

import types

import pytest
import torch

from slipstream.inference.limits import check_max_out_tokens, requested_tokens

PROMPT = torch.zeros(2, 7, dtype=torch.long)


def test_new_tokens_count_from_the_prompt_and_keywords_win() -> None:
    config = types.SimpleNamespace(max_new_tokens=None, max_length=20)
    assert requested_tokens((PROMPT,), {"max_new_tokens": 5}, config) == 12
    assert requested_tokens((), {"input_ids": PROMPT, "max_length": 9}, config) == 9
    assert requested_tokens((PROMPT,), {}, config) == 20  # the model's generation config
    assert requested_tokens((PROMPT,), {"max_length": 30, "max_new_tokens": 3}, config) == 10
    given = types.SimpleNamespace(max_new_tokens=4, max_length=None)
    assert requested_tokens((PROMPT,), {"generation_config": given}, config) == 11
    assert requested_tokens((), {"max_new_tokens": 5}, config) is None  # no token prompt: nothing to count


def test_a_call_beyond_max_out_tokens_is_refused_by_name() -> None:
    check_max_out_tokens((PROMPT,), {"max_new_tokens": 5}, None, 12)  # exactly the bound: taken
    with pytest.raises(ValueError, match=r"13 positions.*hybrid_engine.max_out_tokens \(12\)"):
        check_max_out_tokens((PROMPT,), {"max_new_tokens": 6}, None, 12)
