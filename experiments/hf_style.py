"""A HuggingFace-style example: dict batches of variable-length token sequences, a model that computes its own loss.

The model takes `input_ids`, `attention_mask` and `labels` as keyword arguments and returns a dict with
`loss` and `logits`, as `transformers` models do, so it runs under `task=model` (see conf/experiment/hf_style.yaml).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class TokenSequences(Dataset):
    """`{"input_ids": (L,), "labels": ()}` samples whose lengths L differ."""

    def __init__(self, sequences: list[torch.Tensor], labels: torch.Tensor) -> None:
        self.sequences, self.labels = sequences, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sequences[index], "labels": self.labels[index]}


class SentimentData:
    """Token sequences labelled by a fixed random teacher (the sign of their mean token weight).

    `collate_fn` pads each batch to its longest sequence with `pad_id` and adds the `attention_mask`,
    as a HuggingFace data collator does.
    """

    def __init__(self, num_samples: int = 4096, val_samples: int = 1000, vocab_size: int = 64, min_len: int = 4,
                 max_len: int = 32, batch_size: int = 32, seed: int = 0, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        if not (2 <= vocab_size and 1 <= min_len <= max_len and num_samples >= 1 and batch_size >= 1):
            raise ValueError("data: need vocab_size >= 2, 1 <= min_len <= max_len, num_samples >= 1, batch_size >= 1 "
                             f"(got {vocab_size}, {min_len}, {max_len}, {num_samples}, {batch_size})")
        self.vocab_size, self.batch_size, self.pad_id = vocab_size, batch_size, 0
        self.num_workers, self.pin_memory = num_workers, pin_memory
        generator = torch.Generator().manual_seed(seed)
        weights = torch.randn(vocab_size, generator=generator)
        weights[self.pad_id] = 0.0

        def make(n: int) -> TokenSequences:
            lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator).tolist()
            sequences = [torch.randint(1, vocab_size, (length,), generator=generator) for length in lengths]
            labels = torch.tensor([int(weights[s].mean() > 0) for s in sequences])
            return TokenSequences(sequences, labels)

        self.train_dataset, self.val_dataset = make(num_samples), make(val_samples)

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = sample["input_ids"]
            mask[row, : len(sample["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in samples])}


class BagOfEmbeddingsClassifier(nn.Module):
    """Mean of the unmasked token embeddings, then a two-layer head; returns {"loss", "logits"}."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, num_labels: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, num_labels))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> dict[str, Any]:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        logits = self.head(pooled)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out
