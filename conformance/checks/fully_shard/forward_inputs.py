"""Area "training": what a ``fully_shard`` module may take as forward inputs (P83), and inputs
and outputs nested deep in dataclasses (P117).

[Note: pytree inputs]
FSDP2 hooks a unit's post-backward onto the tensors that require grad among its forward's inputs,
wherever they sit in the arguments: positional or keyword, inside a tuple, a list, a dict, a
``NamedTuple`` or a dataclass, and subclasses of these. Hooking must not change what the forward
receives: each container arrives as the type the caller passed (a ``NamedTuple`` as itself, a
dataclass as itself with its other fields, a ``dict`` or ``list`` subclass as that subclass), with
the same leaf values, and a container holding no tensor that requires grad (a ``NamedTuple`` of a
plain tensor and an int) arrives too. The forward's output, the gradients of the inputs and of the
parameters are then the unsharded model's: the inputs' against the unsharded model run on this
rank's samples with the same inputs, the parameters' against the oracle on the global batch
(``_shared/oracle.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close, backward_and_compare
from conformance.registry import check


class Scaled(NamedTuple):
    """Holds no tensor that requires grad."""

    scale: torch.Tensor
    n: int


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Shift:
    w: torch.Tensor
    tag: str


class Extras(dict):
    pass


class Items(list):
    pass


class Unit(nn.Module):
    """``Linear(5, 3)`` over ``x * scaled.scale + pair.a - pair.b + shift.w + extras["e"] +
    items[0] + kw[0]``; records the type of every container it receives."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[dict] = []

    def forward(self, x, scaled, pair, shift, extras, items, *, kw):
        self.seen.append(
            {
                "scaled": type(scaled),
                "pair": type(pair),
                "shift": type(shift),
                "extras": type(extras),
                "items": type(items),
                "kw": type(kw),
                "n": scaled.n,
                "tag": getattr(shift, "tag", None),
            }
        )
        h = x * scaled.scale + pair.a - pair.b + shift.w + extras["e"] + items[0] + kw[0]
        return self.lin(h)


EXPECTED_TYPES = {
    "scaled": Scaled,
    "pair": Pair,
    "shift": Shift,
    "extras": Extras,
    "items": Items,
    "kw": tuple,
}
VECTORS = ("a", "b", "w", "e", "item", "kw")


def _inputs(x, vectors: dict):
    """The unit's arguments over leaf tensors ``x`` and ``vectors`` (each of shape (5,))."""
    v = vectors
    args = (
        x,
        Scaled(torch.tensor(2.0, device=x.device), 3),
        Pair(v["a"], v["b"]),
        Shift(v["w"], "shift"),
        Extras(e=v["e"]),
        Items([v["item"]]),
    )
    return args, {"kw": (v["kw"],)}


def _leaves(ctx, base_x, base_v):
    x = base_x.clone().requires_grad_(True)
    vectors = {k: t.clone().requires_grad_(True) for k, t in base_v.items()}
    return x, vectors


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def pytree_inputs(ctx):
    """P83: a unit taking ``(x, Scaled(plain tensor, int), Pair(a, b), Shift(w, str),
    Extras(e=...), Items([item]), kw=(t,))`` (every tensor but ``Scaled``'s requires grad; the
    unit is the root) receives each container as the type passed with its non-tensor fields, and
    one step gives the unsharded model's output, input gradients (against the unsharded model on
    this rank's samples) and sharded parameter gradients and values (against the oracle on the
    global batch)."""
    ctx.seed(0)
    model = Unit().to(ctx.device)
    local = copy.deepcopy(model)  # this rank's samples: the inputs' gradients
    oracle = copy.deepcopy(model)  # the global batch: the parameters' gradients
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3183)
    n = ctx.world_size * B
    gx, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    gx, y = gx.to(ctx.device), y.to(ctx.device)
    base_v = {k: torch.randn(5, generator=g).to(ctx.device) for k in VECTORS}
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)

    x, vectors = _leaves(ctx, gx[mine], base_v)
    args, kwargs = _inputs(x, vectors)
    out = model(*args, **kwargs)
    seen = model.seen[-1]
    for key, want in EXPECTED_TYPES.items():
        assert seen[key] is want, (
            f"{ctx.where()} the forward received {key} as {seen[key].__name__}, "
            f"the caller passed {want.__name__}"
        )
    assert (seen["n"], seen["tag"]) == (3, "shift"), (
        f"{ctx.where()} the forward received Scaled.n={seen['n']!r}, Shift.tag={seen['tag']!r}; "
        "the caller passed 3 and 'shift'"
    )

    lx, lvectors = _leaves(ctx, gx[mine], base_v)
    largs, lkwargs = _inputs(lx, lvectors)
    lout = local(*largs, **lkwargs)
    assert_close(ctx, "output", out, lout, FP32["loss"])
    ((lout - y[mine]) ** 2).mean().backward()

    oargs, okwargs = _inputs(gx, {k: t.clone() for k, t in base_v.items()})
    oout = oracle(*oargs, **okwargs)
    backward_and_compare(ctx, model, oracle, (out, oout, y, mine), (opt, oopt), 0)
    assert_close(ctx, "gradient of x", x.grad, lx.grad, FP32["grad"])
    for k in VECTORS:
        assert vectors[k].grad is not None, f"{ctx.where()} input {k} got no gradient"
        assert_close(ctx, f"gradient of input {k}", vectors[k].grad, lvectors[k].grad, FP32["grad"])


# -- deep dataclass nesting (P117) -----------------------------------------------------------------
DEPTH = 100  # dataclass levels around the tensor: under the 128 containers FSDP walks (see P117)


@dataclasses.dataclass
class Link:
    """One level of a chain: ``inner`` is the next ``Link`` or, at the bottom, the tensor."""

    inner: object
    level: int


def _chain(t, depth=DEPTH):
    for level in range(depth):
        t = Link(t, level)
    return t


def _unchain(chain, depth=DEPTH):
    for level in reversed(range(depth)):
        assert type(chain) is Link and chain.level == level, (
            f"link {level} of the chain arrived as {type(chain).__name__}"
        )
        chain = chain.inner
    return chain


class ChainIn(nn.Module):
    """``Linear(5, 3)`` whose input and output are ``DEPTH`` nested ``Link`` s around a tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, chain):
        return _chain(self.lin(_unchain(chain)))


class ChainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ChainIn()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(_unchain(self.inner(_chain(x)))))


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def deep_dataclass_chains(ctx):
    """P117: a unit (``inner``, ``reshard_after_forward=True``, under a root unit) whose forward
    takes a chain of 100 nested dataclasses with a tensor that requires grad at the bottom (the
    root's ``tanh`` input, so within 102 containers of its ``(args, kwargs)``) and returns its
    output in such a chain: FSDP walks both (up to 128 containers deep) without error, the
    chain arrives intact, and one step gives the unsharded model's loss, sharded gradients and
    parameter values (against the oracle on the global batch)."""
    ctx.seed(0)
    model = ChainNet().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model.inner, mesh=ctx.mesh, reshard_after_forward=True)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3184)
    n = ctx.world_size * B
    gx, y = torch.randn(n, 5, generator=g).to(ctx.device), torch.randn(n, 3, generator=g)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x = gx[mine].clone().requires_grad_(True)
    out = model(x)
    oout = oracle(gx.clone().requires_grad_(True))
    backward_and_compare(ctx, model, oracle, (out, oout, y.to(ctx.device), mine), (opt, oopt), 0)
    assert x.grad is not None, f"{ctx.where()} the input got no gradient through the chains"
