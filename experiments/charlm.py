"""Char LM experiment: a byte-level causal transformer trained on the Python standard library's source."""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from runner.data import Batch

VOCAB_SIZE = 256  # every byte value is a token: no tokenizer, no unknown symbols
# Folders skipped in the walk: third-party code is not the standard library, and test suites are
# mostly generated or repetitive data that would dominate a small sample.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
Part = tuple[str, bytes]  # a file's path relative to the library root, and the bytes taken from it


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The standard library's `*.py` files under `root`, sorted by relative path so the order is fixed."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class ByteChunks(Dataset):
    """Non-overlapping `block_size` windows of a byte stream; targets are the inputs shifted one byte."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.dtype != torch.uint8 or data.ndim != 1:
            raise ValueError(f"data must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
        self.data, self.block_size = data, block_size
        # Each window needs one byte past its end for the last target; a shorter tail is dropped.
        self.offsets = torch.arange(max(0, (len(data) - 1) // block_size)) * block_size
        self._span = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> Batch:
        # One gather for the whole batch instead of a slice per sample and a stack in collate.
        windows = self.data[self.offsets[torch.as_tensor(indices)].unsqueeze(1) + self._span].long()
        # Contiguous copies: a loss may .view() the targets, which a strided slice would refuse.
        return Batch((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))


class StdlibText:
    """Byte windows of the standard library's source; whole files go to train or validation, never both.

    The split is a function of `seed` and the installed library, so it is the same on every machine with
    the same Python version; another version has other files and so other text.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        _require(block_size >= 1, "block_size", block_size, ">= 1")
        _require(batch_size >= 1, "batch_size", batch_size, ">= 1")
        _require(max_bytes > block_size, "max_bytes", max_bytes, f"> block_size ({block_size})")
        _require(0 <= val_fraction < 1, "val_fraction", val_fraction, "in [0, 1)")
        _require(num_workers >= 0, "num_workers", num_workers, ">= 0")
        self.block_size, self.batch_size = block_size, batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_sources(root)
        if not files:
            raise RuntimeError(f"no *.py files found under the standard library folder {root}")
        # A seeded order samples the whole library, not just the alphabetically first packages.
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
        val_budget = round(max_bytes * val_fraction)
        train_parts, val_parts = self._fill(root, [files[i] for i in order], val_budget, max_bytes - val_budget)
        self.train_files, self.val_files = [n for n, _ in train_parts], [n for n, _ in val_parts]
        self.train_dataset = ByteChunks(self._join(train_parts), block_size)
        self.val_dataset = ByteChunks(self._join(val_parts), block_size)
        self.num_train_tokens = len(self.train_dataset.data)
        self.num_val_tokens = len(self.val_dataset.data)

    @staticmethod
    def _fill(root: Path, files: list[Path], val_budget: int, train_budget: int) -> tuple[list[Part], list[Part]]:
        """Whole files, in order, to validation until its budget is met, then to train until its is."""
        splits: tuple[list[Part], list[Part]] = ([], [])
        budgets, used = (train_budget, val_budget), [0, 0]
        for path in files:
            split = 1 if used[1] < budgets[1] else 0
            if used[split] >= budgets[split]:
                break
            # Cut the last file at the budget so max_bytes bounds the memory and the epoch length.
            text = path.read_bytes()[: budgets[split] - used[split]]
            if not text:  # empty __init__.py files add nothing but a name
                continue
            splits[split].append((path.relative_to(root).as_posix(), text))
            used[split] += len(text)
        return splits

    @staticmethod
    def _join(parts: list[Part]) -> torch.Tensor:
        blob = b"".join(text for _, text in parts)
        if not blob:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        # One uint8 tensor over the bytes: no per-byte Python objects.
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (B, T, 3D) -> three (B, H, T, D/H) tensors.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Decoder-only transformer: token ids (B, T) with T <= block_size -> next-token logits (B, T, vocab_size).

    LayerNorm only, never BatchNorm: each sequence is computed alone, so results do not depend on how
    a batch is split across processes. The causal mask also means right padding leaves the logits of
    earlier positions unchanged.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 128,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        _require(vocab_size >= 2, "vocab_size", vocab_size, ">= 2")
        _require(block_size >= 1, "block_size", block_size, ">= 1")
        _require(n_layers >= 1, "n_layers", n_layers, ">= 1")
        _require(n_heads >= 1, "n_heads", n_heads, ">= 1")
        multiple = d_model >= 1 and d_model % n_heads == 0
        _require(multiple, "d_model", d_model, f"a positive multiple of n_heads ({n_heads})")
        _require(0 <= dropout < 1, "dropout", dropout, "in [0, 1)")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layers)
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2's scheme: small normal weights, and residual projections shrunk by depth so the
        # residual stream's variance does not grow with the number of blocks.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.ndim != 2 or idx.shape[1] > self.block_size:
            raise ValueError(
                f"idx has shape {tuple(idx.shape)}: must be (batch, T) with T <= block_size ({self.block_size})"
            )
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
