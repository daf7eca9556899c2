"""Area "wrap": policies that name classes match instances, subclasses included (W17).

[Note: class policies and subclasses]
``ModuleWrapPolicy(classes)`` and ``transformer_auto_wrap_policy(transformer_layer_cls=classes)``
select a module iff ``isinstance(module, tuple(classes))``: a subclass of a listed block is
selected too (a model that specialises its transformer block still gets one unit per block),
while an instance of a listed class's *base* class is not. The model below holds one module of
each kind, so the expected units follow from the class hierarchy alone:

  ``Stack``: ``blocks`` = Sequential(Block, SubBlock, SubSubBlock, Other), then ``head``;
  ``SubBlock(Block)``, ``SubSubBlock(SubBlock)``; ``Other`` is a sibling class (not a Block).
  classes {Block}    → blocks.0, blocks.1, blocks.2 (+ the root)
  classes {SubBlock} → blocks.1, blocks.2 (+ the root)

Three paths must agree with that: the policy asked directly (the wrap question of the callable
protocol, and ``ModuleWrapPolicy._run_policy``'s targets), FSDP1's constructor
(``FullyShardedDataParallel(model, auto_wrap_policy=...)``: the FSDP modules it builds, and a
forward equal to the unwrapped model's), and a plan builder where the implementation has one.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks.wrap._helpers import device_id, fsdp1_units
from conformance.registry import check


class Block(nn.Module):
    """Linear(4, 4) -> tanh: the listed block class."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class SubBlock(Block):
    """A specialised block: a subclass of Block with one more parameter."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return super().forward(x) * self.scale


class SubSubBlock(SubBlock):
    """A subclass of a subclass (two levels below Block)."""


class Other(nn.Module):
    """Same shape as Block but not a subclass of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), SubBlock(), SubSubBlock(), Other())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


CLASSES = {"Block": Block, "SubBlock": SubBlock}
# the isinstance rule applied to Stack by hand (see the Note), root excluded
EXPECTED = {
    "Block": {"blocks.0", "blocks.1", "blocks.2"},
    "SubBlock": {"blocks.1", "blocks.2"},
}


def make_policy(W, form: str, listed: str):
    cls = CLASSES[listed]
    if form == "module-wrap-policy":
        return W.ModuleWrapPolicy({cls})
    return functools.partial(W.transformer_auto_wrap_policy, transformer_layer_cls={cls})


CASES = {
    f"{form}-{listed}": {"form": form, "listed": listed}
    for form in ("module-wrap-policy", "transformer")
    for listed in CLASSES
}


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def class_policy_answers(ctx):
    """W17: asked directly, ``ModuleWrapPolicy({C})`` and ``transformer_auto_wrap_policy`` with
    ``{C}`` answer the wrap question True exactly for instances of C and of its subclasses (never
    for a base-class or sibling-class instance), and ``ModuleWrapPolicy._run_policy`` targets
    exactly those modules."""
    W = ctx.impl.ns.wrap
    model = Stack()
    for form in ("module-wrap-policy", "transformer"):
        for listed, expected in EXPECTED.items():
            policy = make_policy(W, form, listed)
            for name, module in model.named_modules():
                if not name:
                    continue
                got = policy(module=module, recurse=False, nonwrapped_numel=0)
                want = name in expected
                assert got is want, (
                    f"{ctx.where()} {form}({{{listed}}}) asked to wrap {name} "
                    f"({type(module).__name__}) answered {got!r}, expected {want} (isinstance)"
                )
            if form == "module-wrap-policy":
                targets = policy._run_policy(model, set(), {})
                names = {n for n, m in model.named_modules() if m in targets and n}
                assert names == expected, (
                    f"{ctx.where()} ModuleWrapPolicy({{{listed}}})._run_policy targets "
                    f"{sorted(names)}, expected {sorted(expected)} (every instance, subclasses "
                    "included)"
                )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, cases=CASES)
def fsdp1_class_policy_units(ctx, form, listed):
    """W17: ``FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({C}))`` (or the
    transformer policy with ``{C}``) builds an FSDP module for every instance of C and of its
    subclasses and for no other module but the root, and the wrapped model's forward equals the
    unwrapped model's."""
    ctx.seed(0)
    model = Stack().to(ctx.device)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5)).to(ctx.device)
    expected_out = model(x).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = ctx.impl.ns.FullyShardedDataParallel(
            model,
            auto_wrap_policy=make_policy(ctx.impl.ns.wrap, form, listed),
            device_id=device_id(ctx),
        )
    units = set(fsdp1_units(ctx, wrapped)) - {""}
    assert units == EXPECTED[listed], (
        f"{ctx.where()} {form}({{{listed}}}): FSDP modules {sorted(units)}, expected "
        f"{sorted(EXPECTED[listed])} (every instance, subclasses included)"
    )
    out = wrapped(x)
    assert torch.allclose(out.detach(), expected_out, rtol=1e-5, atol=1e-6), (
        f"{ctx.where()} {form}({{{listed}}}): the wrapped model's output differs from the "
        "unwrapped model's"
    )


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP2_API}, cases=CASES, world_sizes=(1,))
def class_policy_plan(ctx, form, listed):
    """W17: the implementation's plan builder (``ns.wrap.build_wrap_plan``) plans a unit for every
    instance of the listed class and of its subclasses, plus the root last."""
    build = getattr(ctx.impl.ns.wrap, "build_wrap_plan", None)
    if build is None:
        raise NotSupported("a wrap plan builder (ns.wrap.build_wrap_plan)")
    plan = build(Stack(), make_policy(ctx.impl.ns.wrap, form, listed))
    got = [e.module_fqn for e in plan.entries]
    assert got[-1:] == [""] and set(got[:-1]) == EXPECTED[listed], (
        f"{ctx.where()} {form}({{{listed}}}): planned {got}, expected "
        f"{sorted(EXPECTED[listed])} then the root ''"
    )
