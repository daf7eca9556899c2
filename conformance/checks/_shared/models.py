"""Small models shared by the checks. Every rank builds identical values without a seed."""

from __future__ import annotations

import math
import re

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


def expect_error(ctx, what, exc_type, pattern, *steps):
    """Run ``steps`` in order; the first to raise must raise ``exc_type`` matching ``pattern``."""
    try:
        for step in steps:
            step()
    except exc_type as exc:
        assert re.search(pattern, str(exc)), (
            f"{ctx.where()} {what}: {exc_type.__name__} message {str(exc)[:300]!r} does not say "
            f"{pattern!r}"
        )
        return
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} {what}: raised {type(exc).__name__}: {str(exc)[:300]}, "
            f"expected {exc_type.__name__} matching {pattern!r}"
        ) from exc
    raise AssertionError(
        f"{ctx.where()} {what}: accepted; expected {exc_type.__name__} matching {pattern!r}"
    )
