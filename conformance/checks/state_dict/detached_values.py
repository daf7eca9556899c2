"""Area "state_dict": a state dict hands out no tensor that autograd tracks.

``nn.Module.state_dict()`` (``keep_vars=False``, the default) detaches every value, and FSDP's
state-dict hooks build their values (full clones, ShardedTensor shards, DTensors, LOCAL flat
shards) without recording autograd history: a saved value never has ``requires_grad`` set or a
``grad_fn``, also right after a training step. A mutation-campaign survivor (the hook without its
``no_grad``, ``conformance/mutation/triage.toml``) showed that no check looked.
"""

from __future__ import annotations

import torch

from conformance.checks._shared.sd_models import (
    AREA,
    KIND_CASES,
    build,
    first_error_everywhere,
    require_kind,
    train,
)
from conformance.registry import check


def _tensors(value):
    """The tensors a state-dict value exposes: itself, a DTensor's local tensor, a
    ShardedTensor's local shards."""
    out = []
    if isinstance(value, torch.Tensor):
        out.append(("value", value))
        to_local = getattr(value, "to_local", None)
        if callable(to_local):
            out.append(("its local tensor", to_local()))
    local_shards = getattr(value, "local_shards", None)
    if callable(local_shards):
        out += [(f"local shard {i}", s.tensor) for i, s in enumerate(local_shards())]
    return out


# LOCAL hands out the flat parameter's own shard wrapped in a ShardedTensor that keeps the flat
# parameter's requires_grad (upstream's behaviour); like every other kind it records no history
KEEPS_REQUIRES_GRAD = {"local"}


@check(area=AREA, cases=KIND_CASES)
def values_are_detached(ctx, kind):
    """S25: no tensor of the state dict (each kind, after a training step) has a ``grad_fn``: the
    values carry no autograd history; and but for LOCAL (whose ShardedTensor keeps the flat
    parameter's flag) none has ``requires_grad`` set, as ``nn.Module.state_dict`` returns them."""
    require_kind(ctx, kind)
    model = build(ctx)
    train(model, ctx, steps=1)
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, kind))
    for key, value in sd.items():
        for what, tensor in _tensors(value):
            flagged = tensor.requires_grad and kind not in KEEPS_REQUIRES_GRAD
            assert tensor.grad_fn is None and not flagged, (
                f"{ctx.where()} {kind} state dict {key!r}: {what} has requires_grad="
                f"{tensor.requires_grad}, grad_fn={tensor.grad_fn}; a state dict's values are "
                "detached (no autograd history)"
            )
