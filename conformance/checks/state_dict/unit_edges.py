"""Area "state_dict": FSDP1 state dicts of units at the edges of what a unit holds (S48, S49).

[Note: entries that are not parameters]
* Extra state: a module whose ``get_extra_state`` returns a non-tensor (a dict) has the entry
  ``<module>._extra_state`` in ``nn.Module.state_dict()``. An FSDP1 root passes it through its
  FULL ``state_dict()`` unchanged (the very value, under the clean key) next to the tensors, and
  a load hands it back to ``set_extra_state``.
* A unit that owns no parameter: a root whose only parameterised child is its own nested unit
  still owns a buffer. Under FULL ``rank0_only`` every rank's ``state_dict()`` succeeds (the
  root has nothing to gather, so nothing to skip); rank 0 gets every entry with its value and no
  other rank gets a parameter's. (Whether the root's own buffer is left on the other ranks is not
  pinned: torch 2.13 keeps it there, since its post-state-dict hook returns early for a unit
  without parameters before it empties the dict, where S3 says ``{}``.)
The oracle is the unwrapped model's own ``state_dict()``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.sd_models import AREA, first_error_everywhere
from conformance.registry import check


class Tagged(nn.Module):
    """Linear(4, 3) whose extra state is a dict (not a tensor)."""

    def __init__(self, tag):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.tag = tag

    def get_extra_state(self):
        return {"tag": self.tag, "n": 3}

    def set_extra_state(self, state):
        self.tag = state["tag"]

    def forward(self, x):
        return self.lin(x)


@check(area=AREA, requires={base.FULL_STATE_DICT, base.FLAT_PARAM}, world_sizes=(1,))
def extra_state_not_tensor(ctx):
    """S48: an FSDP1 root over ``Sequential(Tagged)`` (extra state ``{"tag": "a", "n": 3}``):
    the FULL ``state_dict()`` holds ``0._extra_state`` equal to that dict next to ``0.lin.*``
    with the unwrapped model's values; loading it into a root built with tag "b" sets the tag back
    to "a" and the parameters to the dict's values."""
    ctx.seed(0)
    plain = nn.Sequential(Tagged("a")).to(ctx.device)
    want = plain.state_dict()
    model = ctx.impl.shard(copy.deepcopy(plain), ctx)
    sd = ctx.impl.state_dict(model, "full")
    assert sorted(sd) == sorted(want), f"{ctx.where()} keys {sorted(sd)}, expected {sorted(want)}"
    assert sd["0._extra_state"] == {"tag": "a", "n": 3}, (
        f"{ctx.where()} 0._extra_state is {sd['0._extra_state']!r}, expected the module's dict"
    )
    for key in ("0.lin.weight", "0.lin.bias"):
        assert torch.equal(sd[key].cpu(), want[key].cpu()), f"{ctx.where()} {key} differs"
    ctx.seed(1)
    fresh_plain = nn.Sequential(Tagged("b")).to(ctx.device)
    fresh = ctx.impl.shard(fresh_plain, ctx)
    ctx.impl.load_state_dict(fresh, sd, "full")
    assert fresh_plain[0].tag == "a", (
        f"{ctx.where()} after the load the extra state's tag is {fresh_plain[0].tag!r}, "
        "expected 'a' from the dict"
    )
    back = ctx.impl.state_dict(fresh, "full")
    for key in ("0.lin.weight", "0.lin.bias"):
        assert torch.equal(back[key].cpu(), want[key].cpu()), f"{ctx.where()} {key} after load"


class BufferRoot(nn.Module):
    """``inner`` Linear(4, 6) (its own unit) and the root's buffer ``buf``; no root parameter."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.register_buffer("buf", torch.arange(6.0))

    def forward(self, x):
        return self.inner(x) + self.buf


@check(area=AREA, requires={base.FULL_STATE_DICT, base.FLAT_PARAM}, world_sizes=(2,))
def rank0_only_unit_without_params(ctx):
    """S49: ``BufferRoot`` with ``inner`` its own unit (the root unit owns no parameter): under
    FULL ``rank0_only`` every rank's ``state_dict()`` succeeds; rank 0 holds ``buf``,
    ``inner.weight`` and ``inner.bias`` with the unwrapped model's values, the other ranks no
    ``inner.*`` entry (any ``buf`` they keep holds its value)."""
    ctx.seed(0)
    plain = BufferRoot().to(ctx.device)
    want = {k: v.detach().cpu() for k, v in plain.state_dict().items()}
    model = ctx.impl.shard(copy.deepcopy(plain), ctx, plan=[("inner", {}), ("", {})])
    sd = first_error_everywhere(ctx, lambda: ctx.impl.state_dict(model, "full", rank0_only=True))
    if ctx.rank == 0:
        assert sorted(sd) == sorted(want), (
            f"{ctx.where()} rank 0 keys {sorted(sd)}, expected {sorted(want)}"
        )
    else:
        assert set(sd) <= {"buf"}, (
            f"{ctx.where()} rank {ctx.rank} keys {sorted(sd)}: with rank0_only no parameter "
            "entry belongs on a rank other than 0"
        )
    for key, value in sd.items():
        assert torch.equal(value.detach().cpu(), want[key]), f"{ctx.where()} {key} differs"
