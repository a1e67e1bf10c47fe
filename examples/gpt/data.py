"""The character-level dataset of the GPT example, over the text file shipped in `data/tiny_corpus.txt`.

Owns the tokenizer (the sorted set of characters of the corpus; ids in order) and the split of the text
into training samples: sample `i` is the window of `block_size + 1` characters starting at `i * stride`,
returned as `(inputs, targets)` shifted by one. It is a map-style dataset, so `slipstream.initialize(...,
training_data=dataset)` shards it over the data-parallel ranks with a DistributedSampler.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


class CharDataset(Dataset):
    """Overlapping windows of a text file as (inputs, targets) pairs of character ids."""

    def __init__(self, path: Path = CORPUS, *, block_size: int = 128, stride: int | None = None) -> None:
        if not path.is_file():
            raise FileNotFoundError(
                f"corpus {path} not found; regenerate it with `python examples/gpt/make_corpus.py`"
            )
        text = path.read_text(encoding="ascii")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.stride = stride or block_size // 2
        if len(self.data) < block_size + 1:
            raise ValueError(
                f"corpus {path} has {len(self.data)} characters, fewer than block_size + 1 = {block_size + 1}"
            )

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.data[start : start + self.block_size + 1]
        return window[:-1], window[1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)
