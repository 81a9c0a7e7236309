"""A deterministic synthetic token stream: no download, and sample i depends only on (seed, i).

The tokens follow a random sparse bigram "grammar" drawn from the seed: each token has `branching` possible
successors. A model can learn it (the loss falls below log(vocab) towards log(branching)), so training
curves mean something, and any sample can be regenerated on its own, which is what an exact resume needs:
the data position is just the sampler's position.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.utils.data import Dataset

from detrace.errors import UsageError


class SyntheticTokens(Dataset[torch.Tensor]):
    """`num_samples` sequences of `seq_len + 2` token ids (inputs [T] and next-token/MTP targets [T + 1])."""

    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int, branching: int = 4) -> None:
        if min(num_samples, seq_len, branching) < 1 or vocab_size < 2:
            raise UsageError("the synthetic data needs num_samples, seq_len, branching >= 1 and vocab_size >= 2")
        self.num_samples, self.seq_len, self.seed = num_samples, seq_len, seed
        grammar = torch.Generator().manual_seed(seed)
        # successors[v] are the `branching` tokens that may follow token v
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=grammar)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        # One generator per sample, seeded from (seed, index): independent of the order samples are drawn in.
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        vocab, branching = self.successors.shape
        first = torch.randint(0, vocab, (1,), generator=g)
        choices = torch.randint(0, branching, (self.seq_len + 1,), generator=g).tolist()
        tokens = [int(first)]
        for c in choices:
            tokens.append(int(self.successors[tokens[-1], c]))
        return torch.tensor(tokens)  # [seq_len + 2]


class Poisoned(Dataset[torch.Tensor]):
    """`dataset` with the samples `indices` poisoned: each is one token repeated (the model, taught the grammar's
    successors, predicts anything but a run of one token). A planted data fault, off unless asked for."""

    def __init__(self, dataset: SyntheticTokens, indices: Collection[int], *, token: int = 0) -> None:
        self.dataset, self.indices, self.token = dataset, frozenset(indices), token

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        clean = self.dataset[index]
        return torch.full_like(clean, self.token) if index in self.indices else clean


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T + 2] -> inputs [B, T], targets [B, T + 1] (targets[:, t] follows inputs[:, t])."""
    return batch[:, :-2], batch[:, 1:]
