"""Area "fsdp1_runtime": indexing a unit that wraps an ``nn.Sequential`` (R62).

[Note: indexing through the unit]
A unit built over an ``nn.Sequential`` answers ``unit[key]`` as the wrapped Sequential does, so
code written for the plain Sequential keeps working once it is wrapped: an int (also a negative
one) gives the very layer object the Sequential holds at that position, and a slice gives a
Sequential of those very layers, in order. The layers are the wrapped module's own (not copies),
so a forward through them outside the unit, inside ``summon_full_params``, equals the unwrapped
model's layers.
"""

from __future__ import annotations

from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.registry import check


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_API}, world_sizes=(1, 2))
def sequential_indexing(ctx):
    """R62: ``unit[i]`` on a unit wrapping ``nn.Sequential(a, tanh, b)`` is the Sequential's own
    layer at i (0, 2, -1: the very objects), and ``unit[0:2]`` a Sequential of ``a`` and the
    tanh, those very objects in order."""
    ctx.seed(0)
    layers = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)]
    seq = nn.Sequential(*layers).to(ctx.device)
    kwargs = _kwargs(ctx)
    unit = ctx.impl.ns.FullyShardedDataParallel(seq, **kwargs)
    for key, want in ((0, layers[0]), (2, layers[2]), (-1, layers[2]), (1, layers[1])):
        got = unit[key]
        assert got is want, (
            f"{ctx.where()} unit[{key}] is {type(got).__name__} {id(got)}, expected the wrapped "
            f"Sequential's own layer {key} ({type(want).__name__})"
        )
    part = unit[0:2]
    assert (
        isinstance(part, nn.Sequential)
        and list(part) == layers[:2]
        and all(p is w for p, w in zip(part, layers[:2]))
    ), f"{ctx.where()} unit[0:2] is {part!r}, expected a Sequential of the first two layers"
