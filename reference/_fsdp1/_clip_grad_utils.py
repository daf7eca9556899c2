"""Gradient clipping over a sharded model: ``FullyShardedDataParallel.clip_grad_norm_``.

[Note: the total norm of sharded gradients]
  The rule is ``torch.nn.utils.clip_grad_norm_`` 's, applied to the unsharded gradients: ``total``
  is the p-norm of every gradient viewed as one vector, and every gradient is multiplied by
  ``min(1, max_norm / (total + 1e-6))``, the same factor on every rank.

  A sharded unit's gradient elements each live on exactly one rank (the padding is zero), while a
  *non-sharded* gradient (a NO_SHARD unit, or a parameter FSDP does not manage) is the same on
  every rank. So, with the local norms taken in fp32:
    p finite   ``total ** p = sum over ranks of sharded_local ** p  +  nonsharded ** p``
               (the non-sharded part is added after the all-reduce, so it counts once);
    p = inf    ``total = max over ranks of max(sharded_local, nonsharded)``.
  When no unit is sharded (every world of one), it is ``torch.nn.utils.clip_grad_norm_`` itself.

  The returned norm has the promoted dtype of this rank's gradients (low precision only when
  every gradient is); a rank without any gradient returns fp32 and warns.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from reference._fsdp1._common_utils import _fsdp_modules, _warn


def _local_norm(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """The fp32 p-norm of ``grads`` viewed as one vector (0 for no gradient)."""
    if not grads:
        return torch.zeros((), device=device)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _split_params(root: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(sharded, non-sharded) parameters of the tree, each once: a sharded unit contributes its
    flat parameter (or, with ``use_orig_params``, its original parameters' sharded views)."""
    sharded, nonsharded, seen = [], [], set()
    for fsdp in _fsdp_modules(root):
        handle = fsdp._handle
        if handle is None:
            continue
        params = handle._orig_params if handle._use_orig_params else [handle.flat_param]
        target = sharded if handle.uses_sharded_strategy else nonsharded
        for p in params:
            if p not in seen:
                seen.add(p)
                target.append(p)
    nonsharded += [p for p in root.parameters() if p not in seen]  # not FSDP-managed
    return sharded, nonsharded


@torch.no_grad()
def _clip_grad_norm(root, max_norm: float, norm_type: float) -> torch.Tensor:
    """See [Note: the total norm of sharded gradients]; ``root`` is the root FSDP module."""
    sharded, nonsharded = _split_params(root)
    if not sharded:
        return nn.utils.clip_grad_norm_(list(root.parameters()), max_norm, norm_type)
    max_norm, norm_type = float(max_norm), float(norm_type)
    device = root.compute_device
    local = _local_norm([p.grad for p in sharded if p.grad is not None], norm_type, device)
    rest = _local_norm([p.grad for p in nonsharded if p.grad is not None], norm_type, device)
    if norm_type == math.inf:
        total = torch.maximum(local, rest)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=root.process_group)
    else:
        total = local**norm_type
        dist.all_reduce(total, group=root.process_group)
        total = (total + rest**norm_type) ** (1.0 / norm_type)
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad for p in sharded + nonsharded if p.grad is not None]
    for g in grads:
        g.mul_(factor.to(g.device, g.dtype))
    if not grads:
        _warn(
            f"Called FSDP.clip_grad_norm_() on rank {root.rank} with no gradients -- returning "
            f"the total norm in the default dtype {total.dtype}"
        )
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))
