"""Area "wrap": modules whose ``named_children()`` override yields ``None`` entries (W26).

[Note: a None child is no child]
``nn.Module.named_children()`` never yields a child registered as ``None``, but an override may
yield ``(name, None)`` pairs. FSDP1's auto-wrap walks the tree through ``named_children()`` to
decide what each planned unit manages (W12's mixed ``requires_grad`` rule); such an entry is
skipped there and the walk goes on with the next child, at every level. So on ``_HoleyRoot``
(``head`` Linear(4, 4), then ``block``; each of the two yields a ``None`` entry before its real
children) whose ``block`` (a trainable ``scale`` (4,) and ``lin`` Linear(4, 4) with a frozen
weight) is planned by ``ModuleWrapPolicy({_HoleyBlock})``, ``block`` is the unit found mixing
frozen and trainable parameters: with ``use_orig_params=False`` the constructor raises
ValueError naming unit ``block``, its trainable ``block.scale`` and ``block.lin.bias`` and its
frozen ``block.lin.weight``. A walk that stopped at the ``None`` entry would miss ``lin`` inside
``block`` (nothing mixed) or ``block`` inside the root (the root would be blamed).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.wrap._helpers import device_id, expect_raise
from conformance.registry import check


class _HoleyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)
        self.lin.weight.requires_grad_(False)

    def named_children(self):
        yield "hole", None
        yield from super().named_children()

    def forward(self, x):
        return self.lin(x) * self.scale


class _HoleyRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.block = _HoleyBlock()

    def named_children(self):
        yield "hole", None
        yield from super().named_children()

    def forward(self, x):
        return self.block(self.head(x))


MESSAGE = (
    "block has both parameters with requires_grad=True and False. FSDP does not support "
    "wrapping such modules when use_orig_params=False. If possible, wrap the frozen parameters "
    "with FSDP separately.\n"
    "The following parameters have requires_grad=True:\n['block.scale', 'block.lin.bias']\n"
    "The following parameters have requires_grad=False:\n['block.lin.weight']"
)


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def fsdp1_none_children_skipped(ctx):
    """W26: ``None`` entries a ``named_children()`` override yields are skipped, not the end of
    the walk: on ``_HoleyRoot`` (a ``None`` entry before the real children at the root and in
    ``block``) with ``ModuleWrapPolicy({_HoleyBlock})`` and ``use_orig_params=False``, FSDP1's
    constructor raises ValueError naming unit ``block`` with trainable ``['block.scale',
    'block.lin.bias']`` and frozen ``['block.lin.weight']`` (W12)."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = _HoleyRoot()

    def build():
        return ns.FullyShardedDataParallel(
            model,
            auto_wrap_policy=ns.wrap.ModuleWrapPolicy({_HoleyBlock}),
            use_orig_params=False,
            device_id=device_id(ctx),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect_raise(ctx, "W26", ValueError, MESSAGE, build)
