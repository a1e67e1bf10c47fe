"""The prompts of a tensor-parallel generation group, gathered into one batch, and each rank's rows of the answer.

Every rank of the group brings its own prompts (`input_ids` of any batch size and length, an optional
`attention_mask`). Phase 1 gathers every rank's (rows, length); phase 2 gathers the prompts themselves, each
rank's block left-padded to the longest length (as Hugging Face pads for generation: pad id in front, mask 0)
and to the largest batch (rows dropped again after the gather), ids and mask in one message. The group then
generates the whole batch; `own_rows` gives a rank back its rows, without the columns of padding added here,
so its answer has the shape its own `generate` would have had (longer only when another rank's rows made the
group generate past the point where all of this rank's rows had finished).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from slipstream.comm import collectives

__all__ = ["GroupPrompts", "gather_prompts"]


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPrompts:
    input_ids: torch.Tensor
    """Every rank's rows, in rank order, left-padded to one length."""
    attention_mask: torch.Tensor
    first_row: int
    """Where this rank's rows start in the batch."""
    num_rows: int
    added_columns: int
    """Columns of padding put in front of this rank's prompts."""

    def own_rows(self, sequences: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the group's generated `sequences`, without the padding added here."""
        rows = sequences[self.first_row : self.first_row + self.num_rows]
        return rows[:, self.added_columns :]


def _default_mask(input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """The mask Hugging Face's generate infers when none is given: pad tokens masked when the prompt has any."""
    if pad_id is not None and bool((input_ids == pad_id).any()):
        return input_ids.ne(pad_id).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def gather_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, pad_id: int, group: dist.ProcessGroup
) -> GroupPrompts:
    """Every rank's prompts of `group` as one left-padded batch (collective over `group`; see the module doc)."""
    if input_ids.dim() != 2:
        raise ValueError(
            f"engine.generate with hybrid_engine.inference_tp_size > 1: input_ids of shape {tuple(input_ids.shape)}; "
            "pass a 2-D (batch, length) tensor of token ids"
        )
    mask = _default_mask(input_ids, pad_id) if attention_mask is None else attention_mask.long()
    size, me = dist.get_world_size(group), dist.get_rank(group)
    # Phase 1: every rank's (rows, length)
    shape = torch.tensor(input_ids.shape, dtype=torch.long, device=input_ids.device)
    shapes = shape.new_empty(2 * size)
    collectives.all_gather(shapes, shape, group=group)
    rows, lengths = shapes.view(size, 2).unbind(1)
    most_rows, longest = int(rows.max()), int(lengths.max())
    # Phase 2: the prompts, ids and mask of each rank in one (2, most_rows, longest) block
    block = torch.zeros((2, most_rows, longest), dtype=torch.long, device=input_ids.device)
    block[0].fill_(pad_id)
    block[0, : input_ids.shape[0], longest - input_ids.shape[1] :] = input_ids
    block[1, : input_ids.shape[0], longest - input_ids.shape[1] :] = mask
    gathered = block.new_empty((size, *block.shape))
    collectives.all_gather(gathered.view(-1), block.view(-1), group=group)
    counts = rows.tolist()
    ids = torch.cat([gathered[r, 0, : counts[r]] for r in range(size)])
    masks = torch.cat([gathered[r, 1, : counts[r]] for r in range(size)])
    return GroupPrompts(
        input_ids=ids.to(input_ids.dtype),
        attention_mask=masks,
        first_row=sum(counts[:me]),
        num_rows=counts[me],
        added_columns=longest - input_ids.shape[1],
    )
