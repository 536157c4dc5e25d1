"""A real text corpus available everywhere: the documentation topics in the standard library's pydoc_data."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def corpus_text(max_chars: int | None = None) -> str:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return text[:max_chars] if max_chars else text


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Byte-level next-character prediction windows of ``block_size`` over the corpus."""

    def __init__(self, text: str, block_size: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


VOCAB_SIZE = 256  # bytes


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")
