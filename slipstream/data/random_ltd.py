"""Random layerwise token dropping (random-LTD, https://arxiv.org/abs/2211.11586): the kept-token schedule and
the token arithmetic of the wrapped layers (random_ltd_layer.py wraps them).

The schedule (fixed_linear, DeepSpeed's one type): at global step g the wrapped layers keep
    k(g) = min(max_value, m - m % seq_per_step),  m = floor(g / require_steps * (max_value - min_value) + min_value)
tokens. As in DeepSpeed the engine moves it before each training forward with the global step of that forward
(the first forward sees k(0)), and stops moving it once it reaches max_value; it also counts the layer tokens
consumed so far (per step: global batch x (k x dropping layers + max_value x the other layers)). The state (kept
count, step, consumed tokens) travels in checkpoints.

[Note: random-LTD tokens] For one forward, the first dropping layer draws, for every dropping layer and every
sample, k distinct positions uniformly at random and sorts them (so a causal layer keeps its order); the other
dropping layers use their own rows of that draw (`TokenDraw`). A layer then runs on the gathered tokens, and its
output is scattered back into a copy of its input: dropped positions pass through unchanged. A decoder's causal
mask is cut to its first k rows and columns (the causal pattern of any sorted subset); an encoder's padding mask
has the kept rows and columns gathered, per layer and sample. Gather and scatter are differentiable, so the
gradient reaches a kept token through the layer and a dropped one directly.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from slipstream.config.random_ltd_plan import RandomLTDPlan

__all__ = ["RandomLTDScheduler", "TokenDraw", "draw_tokens", "gather_tokens", "scatter_tokens"]


class RandomLTDScheduler:
    """The kept-token count per global step for one `RandomLTDPlan`; DeepSpeed's `RandomLTDScheduler` methods."""

    def __init__(self, plan: RandomLTDPlan, *, train_batch_size: int) -> None:
        self.plan = plan
        self.random_ltd_layer_num = plan.random_ltd_layer_num
        self.global_batch_size = train_batch_size
        self.draw: TokenDraw | None = None
        """The token draw of the current forward (see [Note: random-LTD tokens])."""
        self.reset_to_init()

    def reset_to_init(self) -> None:
        self.current_value = self.plan.min_value
        self.consumed_layer_tokens = 0
        self.current_steps = -1

    def get_value(self, global_steps: int) -> int:
        """The schedule's kept count at `global_steps` (whatever the current count is)."""
        plan = self.plan
        if plan.schedule_type != "fixed_linear":
            raise ValueError(
                f"random-LTD: schedule_type {plan.schedule_type!r} is not one of DeepSpeed's (fixed_linear)"
            )
        grown = math.floor(global_steps / plan.require_steps * (plan.max_value - plan.min_value) + plan.min_value)
        return min(grown - grown % plan.seq_per_step, plan.max_value)

    def update_seq(self, global_steps: int) -> int:
        """Move the kept count to the schedule's at `global_steps` (until it has reached max_value) and count the
        step's layer tokens once per step."""
        plan = self.plan
        if self.current_value < plan.max_value:
            self.current_value = self.get_value(global_steps)
        if global_steps != self.current_steps:
            dropping = self.random_ltd_layer_num
            full = plan.total_layer_num - dropping
            self.consumed_layer_tokens += self.global_batch_size * (
                self.current_value * dropping + plan.max_value * full
            )
            self.current_steps = global_steps
        return self.current_value

    def get_current_seq(self) -> int:
        return self.current_value

    def set_current_seq(self, seq_length: int) -> None:
        self.current_value = int(seq_length)

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The layer tokens consumed after `train_iters` more steps from here (DeepSpeed's helper; it moves the
        schedule as training would)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.consumed_layer_tokens

    def get_state(self) -> dict[str, int]:
        """DeepSpeed's state keys (Megatron-DeepSpeed logs `consumed_layer_tokens` from it)."""
        return self.state_dict()

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's keys."""
        return {
            "consumed_layer_tokens": self.consumed_layer_tokens,
            "current_steps": self.current_steps,
            "current_value": self.current_value,
            "min_value": self.plan.min_value,
            "max_value": self.plan.max_value,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_layer_tokens = int(state["consumed_layer_tokens"])
        self.current_steps = int(state["current_steps"])
        self.current_value = int(state["current_value"])


@dataclasses.dataclass(frozen=True)
class TokenDraw:
    """The kept positions of one forward: `indices` [dropping layers, batch, kept], sorted along the last dim;
    `masks` the attention mask each dropping layer receives (None without a mask)."""

    indices: torch.Tensor
    masks: tuple[torch.Tensor | None, ...]


def draw_tokens(
    kept: int, *, seq_len: int, batch: int, layers: int, device: torch.device, mask: torch.Tensor | None, encoder: bool
) -> TokenDraw:
    """`kept` distinct positions of `seq_len`, uniformly at random and sorted, for each layer and sample, and the
    masks that go with them (see [Note: random-LTD tokens])."""
    noise = torch.rand(layers * batch, seq_len, device=device)
    indices = noise.argsort(dim=-1)[:, :kept].sort(dim=-1).values.view(layers, batch, kept)
    if mask is None:
        return TokenDraw(indices, (None,) * layers)
    if not encoder:
        return TokenDraw(indices, (mask[..., :kept, :kept],) * layers)
    return TokenDraw(indices, tuple(_gather_mask(mask, rows) for rows in indices))


def _gather_mask(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """mask[b, :, rows[b], :][..., rows[b]] for each sample b (mask: [batch, heads or 1, seq, seq])."""
    batch, heads, seq, _ = mask.shape
    kept = rows.shape[-1]
    picked = mask.gather(2, rows[:, None, :, None].expand(batch, heads, kept, seq))
    return picked.gather(3, rows[:, None, None, :].expand(batch, heads, kept, kept))


def _index(hidden: torch.Tensor, rows: torch.Tensor, batch_first: bool) -> tuple[int, torch.Tensor]:
    """The sequence dim of `hidden` and `rows` ([batch, kept]) expanded to index it along that dim."""
    width = hidden.shape[2:]
    if batch_first:
        return 1, rows.view(*rows.shape, *(1,) * len(width)).expand(*rows.shape, *width)
    flipped = rows.t()
    return 0, flipped.reshape(*flipped.shape, *(1,) * len(width)).expand(*flipped.shape, *width)


def gather_tokens(hidden: torch.Tensor, rows: torch.Tensor, *, batch_first: bool) -> torch.Tensor:
    """The kept tokens of `hidden` ([batch, seq, ...] or [seq, batch, ...]) at positions `rows` [batch, kept]."""
    dim, index = _index(hidden, rows, batch_first)
    return hidden.gather(dim, index)


def scatter_tokens(hidden: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor, *, batch_first: bool) -> torch.Tensor:
    """A copy of `hidden` with the tokens at `rows` replaced by `kept` (the layer's output on them)."""
    dim, index = _index(hidden, rows, batch_first)
    return hidden.scatter(dim, index, kept.to(hidden.dtype))
