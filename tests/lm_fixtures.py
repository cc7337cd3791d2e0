"""Task fixtures named by `_target_=lm_fixtures.<Name>`: variable-length sequences, tiny causal models, bad models."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

IGNORE = -100


class Sequences(Dataset):
    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


class PaddedSequences:
    """Token sequences of random lengths from a fixed random Markov chain; batches padded to their longest.

    `dict_batches`: {"input_ids", "labels"} (labels unshifted, as HuggingFace causal models take them);
    otherwise (inputs, targets) with targets shifted by one and padding marked -100.
    """

    def __init__(self, num_samples: int = 96, val_samples: int = 33, vocab_size: int = 16, min_len: int = 3,
                 max_len: int = 12, batch_size: int = 8, seed: int = 0, dict_batches: bool = False) -> None:
        self.batch_size, self.dict_batches, self.vocab_size = batch_size, dict_batches, vocab_size
        generator = torch.Generator().manual_seed(seed)
        transitions = torch.softmax(3 * torch.randn(vocab_size, vocab_size, generator=generator), dim=1)

        def sequence() -> torch.Tensor:
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
            tokens = [int(torch.randint(1, vocab_size, (1,), generator=generator))]
            for _ in range(length - 1):
                tokens.append(int(torch.multinomial(transitions[tokens[-1]], 1, generator=generator)))
            return torch.tensor(tokens)

        self.train_dataset = Sequences([sequence() for _ in range(num_samples)])
        self.val_dataset = Sequences([sequence() for _ in range(val_samples)])

    def collate_fn(self, sequences: list[torch.Tensor]) -> Any:
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        labels = torch.full((len(sequences), longest), IGNORE, dtype=torch.long)
        for row, s in enumerate(sequences):
            ids[row, : len(s)], labels[row, : len(s)] = s, s
        if self.dict_batches:
            return {"input_ids": ids, "labels": labels}
        return ids[:, :-1], labels[:, 1:]


class TinyCausalLM(nn.Module):
    """Embeddings, one causal self-attention layer and a head: logits (B, T, V). No dropout, no batch statistics."""

    def __init__(self, vocab_size: int = 16, dim: int = 16, max_len: int = 32) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab_size, dim), nn.Embedding(max_len, dim)
        self.qkv, self.norm, self.head = nn.Linear(dim, 3 * dim), nn.LayerNorm(dim), nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.norm(x))


class CountingCausalLM(TinyCausalLM):
    """HuggingFace-style: model(input_ids=..., labels=...) shifts the labels itself and returns
    {"loss": mean over the scored tokens, "count": how many, "logits", "accuracy": token accuracy}.

    `report_count=False` leaves `count` out, as HuggingFace models do: each batch's mean then weighs as much
    as any other batch's, however many tokens it holds.
    """

    def __init__(self, vocab_size: int = 16, dim: int = 16, max_len: int = 32, report_count: bool = True) -> None:
        super().__init__(vocab_size, dim, max_len)
        self.report_count = report_count

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, Any]:  # type: ignore[override]
        logits = super().forward(input_ids)
        shifted, targets = logits[:, :-1], labels[:, 1:]
        keep = targets != IGNORE
        loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        hits = (shifted.argmax(-1) == targets) & keep
        out = {"loss": loss, "logits": logits, "accuracy": hits.sum().float() / keep.sum().clamp_min(1)}
        return {**out, "count": keep.sum()} if self.report_count else out


class NoLoss(nn.Module):
    """Under task=model: returns logits but no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, batch: Any) -> dict:
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        return {"logits": self.linear(inputs[:, :3])}


class VectorLoss(NoLoss):
    """Under task=model: returns one loss per sample instead of their mean."""

    def forward(self, batch: Any) -> dict:
        return {"loss": super().forward(batch)["logits"].sum(dim=1)}


class LossOnlyWhenTraining(nn.Module):
    """Wraps the hf_style classifier: in training it returns its loss alone, no logits (to save their copy)."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, num_labels: int = 2) -> None:
        super().__init__()
        from runner.examples.hf_style import BagOfEmbeddingsClassifier

        self.inner = BagOfEmbeddingsClassifier(vocab_size=vocab_size, dim=dim, num_labels=num_labels)

    def forward(self, **batch: Any) -> dict[str, Any]:
        out = self.inner(**batch)
        return {"loss": out["loss"]} if self.training else out


class NoBatchSize:
    """A data object without the batch_size every data object needs."""

    def __init__(self) -> None:
        self.train_dataset = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))


class _Counter:
    """Neither a map-style dataset (no indexing) nor a stream (no iteration)."""

    def __len__(self) -> int:
        return 3


class UnreadableTrain:
    """A data object whose train_dataset can be neither indexed nor iterated."""

    def __init__(self) -> None:
        self.batch_size = 8
        self.train_dataset = _Counter()
