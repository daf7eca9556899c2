"""Small models shared by the checks. Every rank builds identical values without a seed."""

from __future__ import annotations

import math

import torch
from torch import nn


def distinct_values(shape: tuple[int, ...], salt: int, dtype=torch.float32) -> torch.Tensor:
    """Deterministic, pairwise-distinct, non-zero values (so a leaked pad or a shifted row shows)."""
    n = math.prod(shape)
    return (torch.arange(1, n + 1, dtype=torch.float64) + 1000.0 * salt).to(dtype).reshape(shape)


class ParamBag(nn.Module):
    """A module whose only content is parameters ``p0, p1, ...`` of the given shapes."""

    def __init__(self, shapes, dtype=torch.float32):
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(distinct_values(tuple(shape), i, dtype)))

    def forward(self, x):
        return x
