"""The two collectives of FSDP1's flat parameter, under one name across torch versions.

[Note: collective names across torch versions]  torch 2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single`` and made the old names
warn; 2.11 and 2.12 have only the old names. :func:`all_gather_single` and
:func:`reduce_scatter_single` call the new name where it exists, else the old one.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group) -> None:  # Note: collective names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def reduce_scatter_single(output, input, group) -> None:  # Note: collective names
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input, group=group)
