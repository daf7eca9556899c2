"""Area "states": resharding frees the unsharded storage whatever its size, one byte included (P4).

A unit holding a single one-element uint8 parameter (frozen: an integer has no gradient) has an
unsharded storage of ``ws`` bytes (one element per rank's padded shard); at world size 1 that is a
single byte, the smallest storage there is. After a forward with ``reshard_after_forward=True`` it
must be freed (0 bytes) like any other, and a later forward all-gathers the original value again.
The unsharded parameter is captured inside the unit's forward (see ``states.py``'s Note).
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.fully_shard.states import assert_freed
from conformance.registry import check


class Scale8(nn.Module):
    """Multiplies by ``p``, a (1,) uint8 parameter holding 3; records the ``p`` it computes with and its value."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.full((1,), 3, dtype=torch.uint8), requires_grad=False)
        self.seen: list[tuple[torch.Tensor, int]] = []

    def forward(self, h):
        self.seen.append((self.p, int(self.p.item())))  # value read while allocated
        return h * self.p.float()


class Net8(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = Scale8()

    def forward(self, x):
        return self.scale(self.lin(x))


@check(area="states", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.RESHARD_AFTER_FORWARD})
def one_byte_unsharded_storage_freed(ctx):
    """P4: a unit whose only parameter is one uint8 element (``ws`` bytes unsharded, 1 byte at
    world size 1) has that storage freed (0 bytes) after each of two forwards with
    ``reshard_after_forward=True``, and both forwards compute with the value 3."""
    model = Net8().to(ctx.device)
    ctx.impl.ns.fully_shard(model.scale, mesh=ctx.mesh, reshard_after_forward=True)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    x = torch.ones(2, 3, device=ctx.device)
    for i in range(2):
        with torch.no_grad():
            model(x)
        seen, value = model.scale.seen[-1]
        assert seen.dtype == torch.uint8 and seen.numel() == 1, (
            f"{ctx.where()} forward {i}: scale.p computed as {seen.dtype} {tuple(seen.shape)}"
        )
        assert value == 3, f"{ctx.where()} forward {i}: scale.p was {value}, expected 3"
        assert_freed(ctx, "scale.p", seen, f"after forward {i} (reshard_after_forward=True)")
