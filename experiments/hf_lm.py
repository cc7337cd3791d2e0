"""HuggingFace language models built from a config (no download) on synthetic token data in HuggingFace's batch format.

`tiny_gpt2` builds a `GPT2LMHeadModel` and `tiny_bert` a `BertForMaskedLM` from small configs; `MarkovTokens`
yields what `transformers`' collators yield: `{"input_ids", "attention_mask", "labels"}`, the labels equal to
input_ids (causal LM: the model shifts them inside) or masked-token targets (masked LM), -100 where not scored.
Needs `pip install transformers` (see conf/experiment/tiny_gpt2.yaml).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

IGNORE = -100  # the label HuggingFace's losses skip
PAD, MASK = 0, 1  # token ids the data keeps for padding and (masked LM) the mask token


def tiny_gpt2(vocab_size: int = 64, n_positions: int = 64, n_embd: int = 32, n_layer: int = 2,
              n_head: int = 2, dropout: float = 0.0) -> nn.Module:
    """A GPT-2 causal LM of the given sizes, randomly initialised (transformers' own initialisation)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        use_cache=False, pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD)
    return GPT2LMHeadModel(config)


def tiny_bert(vocab_size: int = 64, max_position_embeddings: int = 64, hidden_size: int = 32,
              num_hidden_layers: int = 2, num_attention_heads: int = 2, dropout: float = 0.0) -> nn.Module:
    """A BERT masked LM of the given sizes, randomly initialised."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=num_attention_heads, intermediate_size=2 * hidden_size,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=PAD)
    return BertForMaskedLM(config)


class TokenSequences(Dataset):
    """Sequences of token ids, of different lengths."""

    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sequences[index]}


class MarkovTokens:
    """Token sequences of random lengths from a fixed random Markov chain over ids 2..vocab_size-1.

    `collate_fn` pads each batch to its longest sequence as HuggingFace's collators do. `objective=causal`:
    labels = input_ids, -100 on padding (DataCollatorForLanguageModeling(mlm=False)). `objective=masked`:
    every `mask_every`-th token of a sequence is replaced by the mask token and is the only one scored (a
    fixed pattern, so that a batch means the same on any number of processes).
    """

    def __init__(self, num_samples: int = 512, val_samples: int = 64, vocab_size: int = 64, min_len: int = 4,
                 max_len: int = 32, batch_size: int = 16, objective: str = "causal", mask_every: int = 4,
                 seed: int = 0, num_workers: int = 0, pin_memory: bool = False) -> None:
        if objective not in ("causal", "masked"):
            raise ValueError(f"data.objective={objective!r} is not allowed: use causal or masked")
        if not (3 <= vocab_size and 2 <= min_len <= max_len and num_samples >= 1 and batch_size >= 1
                and mask_every >= 1):
            raise ValueError("data: need vocab_size >= 3, 2 <= min_len <= max_len, num_samples >= 1, batch_size >= 1, "
                             f"mask_every >= 1 (got {vocab_size}, {min_len}, {max_len}, {num_samples}, {batch_size}, "
                             f"{mask_every})")
        self.vocab_size, self.batch_size = vocab_size, batch_size
        self.objective, self.mask_every = objective, mask_every
        self.num_workers, self.pin_memory = num_workers, pin_memory
        generator = torch.Generator().manual_seed(seed)
        transitions = torch.softmax(3 * torch.randn(vocab_size - 2, vocab_size - 2, generator=generator), dim=1)

        def sequence() -> torch.Tensor:
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
            tokens = [int(torch.randint(0, vocab_size - 2, (1,), generator=generator))]
            for _ in range(length - 1):
                tokens.append(int(torch.multinomial(transitions[tokens[-1]], 1, generator=generator)))
            return torch.tensor(tokens) + 2

        self.train_dataset = TokenSequences([sequence() for _ in range(num_samples)])
        self.val_dataset = TokenSequences([sequence() for _ in range(val_samples)])

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = sample["input_ids"]
            mask[row, : len(sample["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, IGNORE)
        if self.objective == "masked":
            masked = (torch.arange(longest) % self.mask_every == self.mask_every - 1) & (mask == 1)
            labels = labels.masked_fill(~masked, IGNORE)
            ids = ids.masked_fill(masked, MASK)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
