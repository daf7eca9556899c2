"""Area "training": what a ``fully_shard`` module may take as forward inputs (P83), list and
tuple subclasses that cannot be rebuilt from one list (P131), dataclasses that cannot be rebuilt
(P132), and inputs and outputs nested deep in dataclasses (P117).

[Note: pytree inputs]
FSDP2 hooks a unit's post-backward onto the tensors that require grad among its forward's inputs,
wherever they sit in the arguments: positional or keyword, inside a tuple, a list, a dict, a
``NamedTuple`` or a dataclass, and subclasses of these. Hooking must not change what the forward
receives: each container arrives as the type the caller passed (a ``NamedTuple`` as itself, a
dataclass as itself with its other fields, a ``dict`` or ``list`` subclass as that subclass), with
the same leaf values, and a container holding no tensor that requires grad (a ``NamedTuple`` of a
plain tensor and an int, a dataclass of a plain tensor and a string, a list of a plain tensor and
an int) arrives too, as itself. The forward's output, the gradients of the inputs and of the
parameters are then the unsharded model's: the inputs' against the unsharded model run on this
rank's samples with the same inputs, the parameters' against the oracle on the global batch
(``_shared/oracle.py``).

[Note: inputs FSDP2 cannot rebuild]
Routing puts new tensors into the containers, so a container holding a tensor that requires grad
is rebuilt: a ``list`` or ``tuple`` subclass by calling its type on the list of new items, a
dataclass by ``dataclasses.replace``. Two kinds cannot be rebuilt that way:
* a ``list`` / ``tuple`` subclass whose constructor does not take one list of items (a tuple
  subclass built as ``Span(lo, hi)``): it arrives as its base type (a plain ``list`` or
  ``tuple``) with the same items in order; training is unaffected (P131);
* a dataclass whose ``dataclasses.replace`` raises TypeError (its own ``__init__`` does not take
  every field): the call is refused with TypeError naming the dataclass, before the forward runs,
  rather than passing the input on without its gradient hook (P132).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
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


@dataclasses.dataclass
class Config:
    """Holds no tensor that requires grad."""

    bias: torch.Tensor
    name: str


class Extras(dict):
    pass


class Items(list):
    pass


class Unit(nn.Module):
    """``Linear(5, 3)`` over ``x * scaled.scale + pair.a - pair.b + shift.w + cfg.bias +
    consts[0] * consts[1] + extras["e"] + items[0] + kw[0]``; records the type of every container
    it receives."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[dict] = []

    def forward(self, x, scaled, pair, shift, cfg, consts, extras, items, *, kw):
        self.seen.append(
            {
                "scaled": type(scaled),
                "pair": type(pair),
                "shift": type(shift),
                "cfg": type(cfg),
                "consts": type(consts),
                "extras": type(extras),
                "items": type(items),
                "kw": type(kw),
                "n": scaled.n,
                "tag": getattr(shift, "tag", None),
                "name": getattr(cfg, "name", None),
                "k": consts[1] if isinstance(consts, list) and len(consts) == 2 else None,
            }
        )
        h = x * scaled.scale + pair.a - pair.b + shift.w + cfg.bias + consts[0] * consts[1]
        return self.lin(h + extras["e"] + items[0] + kw[0])


EXPECTED_TYPES = {
    "scaled": Scaled,
    "pair": Pair,
    "shift": Shift,
    "cfg": Config,
    "consts": list,
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
        Config(torch.full((5,), 0.25, device=x.device), "cfg"),
        [torch.arange(5.0, device=x.device), 2],
        Extras(e=v["e"]),
        Items([v["item"]]),
    )
    return args, {"kw": (v["kw"],)}


def _leaves(ctx, base_x, base_v):
    x = base_x.clone().requires_grad_(True)
    vectors = {k: t.clone().requires_grad_(True) for k, t in base_v.items()}
    return x, vectors


def _sgd_and_batch(ctx, model, oracle, seed: int):
    """(SGD lr 0.1 of ``model``, of ``oracle``, the generator ``seed`` started, a global batch
    ``gx`` (``ws * B`` rows of 5) and targets ``y`` (rows of 3) drawn from it, on the device); the
    generator goes on to draw the inputs' other leaves."""
    g = torch.Generator().manual_seed(seed)
    n = ctx.world_size * B
    gx, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    opts = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(oracle.parameters(), lr=0.1),
    )
    return (*opts, g, gx.to(ctx.device), y.to(ctx.device))


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def pytree_inputs(ctx):
    """P83: a unit taking ``(x, Scaled(plain tensor, int), Pair(a, b), Shift(w, str),
    Config(plain tensor, str), [plain tensor, int], Extras(e=...), Items([item]), kw=(t,))``
    (every tensor but ``Scaled``'s, ``Config``'s and the list's requires grad; the unit is the
    root) receives each container as the type passed with its non-tensor fields, and
    one step gives the unsharded model's output, input gradients (against the unsharded model on
    this rank's samples) and sharded parameter gradients and values (against the oracle on the
    global batch)."""
    ctx.seed(0)
    model = Unit().to(ctx.device)
    local = copy.deepcopy(model)  # this rank's samples: the inputs' gradients
    oracle = copy.deepcopy(model)  # the global batch: the parameters' gradients
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt, oopt, g, gx, y = _sgd_and_batch(ctx, model, oracle, 3183)
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
    got = (seen["n"], seen["tag"], seen["name"], seen["k"])
    assert got == (3, "shift", "cfg", 2), (
        f"{ctx.where()} the forward received (Scaled.n, Shift.tag, Config.name, consts[1]) = "
        f"{got!r}; the caller passed (3, 'shift', 'cfg', 2)"
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


# -- containers that cannot be rebuilt (P131, P132) -------------------------------------------------
class Span(tuple):
    """A tuple subclass built from its two items, ``Span(lo, hi)``: ``Span([lo, hi])`` raises."""

    def __new__(cls, lo, hi):
        return super().__new__(cls, (lo, hi))


class Stack(list):
    """A list subclass built from its two items, ``Stack(a, b)``: ``Stack([a, b])`` raises."""

    def __init__(self, a, b):
        super().__init__((a, b))


class SpanUnit(nn.Module):
    """``Linear(5, 3)`` over ``x + span[0] - span[1] + stack[0] * stack[1]``; records what it
    receives."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[tuple] = []

    def forward(self, x, span, stack):
        self.seen.append((span, stack))
        return self.lin(x + span[0] - span[1] + stack[0] * stack[1])


def _spans(x, v):
    return x, Span(v["lo"], v["hi"]), Stack(v["a"], v["b"])


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def unrebuildable_sequence_inputs(ctx):
    """P131: a unit (the root) taking ``(x, Span(lo, hi), Stack(a, b))``, a ``tuple`` and a
    ``list`` subclass whose constructors take two items (not one list), every tensor requiring
    grad, receives the span as a ``tuple`` and the stack as a ``list`` (the subclass or the plain
    base) holding the routed tensors: the same values in the same order, 2 items each; one step
    gives the unsharded model's output, input gradients (against the unsharded model on this
    rank's samples) and sharded parameter gradients and values (the oracle on the global
    batch)."""
    ctx.seed(0)
    model = SpanUnit().to(ctx.device)
    local, oracle = copy.deepcopy(model), copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt, oopt, g, gx, y = _sgd_and_batch(ctx, model, oracle, 3185)
    names = ("lo", "hi", "a", "b")
    base_v = {k: torch.randn(5, generator=g).to(ctx.device) for k in names}
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, v = _leaves(ctx, gx[mine], base_v)
    out = model(*_spans(x, v))
    span, stack = model.seen[-1]
    for what, got, want, items in (
        ("Span", span, tuple, ("lo", "hi")),
        ("Stack", stack, list, ("a", "b")),
    ):
        assert isinstance(got, want) and len(got) == 2, (
            f"{ctx.where()} the forward received the {what} as {type(got).__name__} "
            f"of {len(got) if hasattr(got, '__len__') else '?'} items; expected a {want.__name__} "
            "(the subclass or the plain base) of 2"
        )
        for got_t, k in zip(got, items):
            assert_close(ctx, f"{what} item {k} in the forward", got_t, base_v[k], FP32["loss"])
    lx, lv = _leaves(ctx, gx[mine], base_v)
    lout = local(*_spans(lx, lv))
    assert_close(ctx, "output", out, lout, FP32["loss"])
    ((lout - y.to(ctx.device)[mine]) ** 2).mean().backward()
    oout = oracle(*_spans(gx, {k: t.clone() for k, t in base_v.items()}))
    backward_and_compare(ctx, model, oracle, (out, oout, y.to(ctx.device), mine), (opt, oopt), 0)
    for k in ("x", *names):
        got_g, want_g = (x.grad, lx.grad) if k == "x" else (v[k].grad, lv[k].grad)
        assert got_g is not None, f"{ctx.where()} input {k} got no gradient"
        assert_close(ctx, f"gradient of input {k}", got_g, want_g, FP32["grad"])


@dataclasses.dataclass(init=False)
class Scaler:
    """A dataclass with its own constructor, ``Scaler(t)`` (``factor`` is always 2):
    ``dataclasses.replace`` passes both fields and raises TypeError."""

    t: torch.Tensor
    factor: float

    def __init__(self, t):
        self.t = t
        self.factor = 2.0


class ScalerUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.calls = 0

    def forward(self, x, scaler):
        self.calls += 1
        return self.lin(x * scaler.factor + scaler.t)


@check(area="training", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def unrebuildable_dataclass_input(ctx):
    """P132: a unit (the root) called with ``(x, Scaler(t))``, ``t`` requiring grad and
    ``Scaler`` a dataclass whose own ``__init__`` takes only ``t`` (so ``dataclasses.replace``
    raises TypeError), is refused with TypeError naming ``Scaler`` before its forward runs; the
    same call with ``t`` not requiring grad (nothing to rebuild) runs and equals the unsharded
    model."""
    ctx.seed(0)
    model = ScalerUnit().to(ctx.device)
    oracle = copy.deepcopy(model)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    g = torch.Generator().manual_seed(3186)
    x = torch.randn(B, 5, generator=g).to(ctx.device).requires_grad_(True)
    t = torch.randn(5, generator=g).to(ctx.device)
    expect_error(
        ctx,
        "a dataclass input dataclasses.replace cannot rebuild",
        TypeError,
        "Scaler",
        lambda: model(x, Scaler(t.clone().requires_grad_(True))),
    )
    assert model.calls == 0, f"{ctx.where()} the forward ran {model.calls} time(s) before refusal"
    out = model(x, Scaler(t))
    assert model.calls == 1, f"{ctx.where()} the forward ran {model.calls} times, expected 1"
    assert_close(
        ctx, "output with a plain tensor in Scaler", out, oracle(x, Scaler(t)), FP32["loss"]
    )


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
    opt, oopt, _, gx, y = _sgd_and_batch(ctx, model, oracle, 3184)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x = gx[mine].clone().requires_grad_(True)
    out = model(x)
    oout = oracle(gx.clone().requires_grad_(True))
    backward_and_compare(ctx, model, oracle, (out, oout, y.to(ctx.device), mine), (opt, oopt), 0)
    assert x.grad is not None, f"{ctx.where()} the input got no gradient through the chains"
