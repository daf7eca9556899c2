"""Area "fsdp1_runtime": FSDP1's recorded forward order (R41-R44).

[Note: the forward order FSDP1 records]
An FSDP1 root remembers the order in which its units ran their first training forward (one
"iteration" ends with the backward). Two features read that record:
* order validation (capability ``fsdp1-exec-order-check``): when the distributed debug level is
  DETAIL at construction (``torch.distributed.set_debug_level(DebugLevel.DETAIL)``), the first
  training forward compares, unit by unit and before each all-gather, which unit every rank is
  about to gather: ranks that disagree get a RuntimeError naming each rank and the parameter
  FQNs of the unit it is gathering (instead of a mismatched collective). A later training
  forward that departs from the first one's order warns (UserWarning naming the rank, the unit
  expected and the unit met), for every departing unit of the first iteration that departs, and
  never again after that iteration. Eval-mode forwards are not checked.
* prefetching (capability ``fsdp1-prefetch``): with ``forward_prefetch=True`` each later
  forward issues, in a unit's pre-forward right after that unit's own all-gather, the all-gather
  of the unit that followed it in the first forward; with ``backward_prefetch=BACKWARD_PRE`` each
  backward issues, in a unit's pre-backward right after its own all-gather, the all-gather of the
  unit that ran before it in that forward. Every unit is still gathered once per pass.
Neither may change a value: the losses and parameters after SGD steps equal the unsharded model's
trained on the global batch (``_shared/oracle.py``'s rule) run in the same order.

The spy of the prefetch check sees the dispatcher's ops (``_shared/collectives.py``'s Note): an
all-gather is known by its output size, ``ws * ceil(N / ws)`` for a unit of N parameter elements
(R10; distinct for the three units here at ws 2) and a unit's computation by its ``addmm``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.collectives import EventSpy
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.registry import check

B = 2
REQUIRES = {base.TRAINING, base.FLAT_PARAM, base.FSDP1_API}
ORDER_TEXT = "Forward order differs"


class Ordered(nn.Module):
    """Three Linear units a, b, c (``dims[i] -> dims[i + 1]``) whose forward runs them in
    ``self.order`` (tanh between)."""

    def __init__(self, dims=(4, 4, 4, 4)):
        super().__init__()
        self.a = nn.Linear(dims[0], dims[1])
        self.b = nn.Linear(dims[1], dims[2])
        self.c = nn.Linear(dims[2], dims[3])
        self.order: tuple[str, ...] = ("a", "b", "c")

    def forward(self, x):
        for name in self.order:
            x = torch.tanh(getattr(self, name)(x))
        return x


def _set_order(model: nn.Module, order: tuple[str, ...]) -> None:
    """Set the run order on the (wrapped) ``Ordered`` module inside ``model``."""
    for m in model.modules():
        if isinstance(m, Ordered):
            m.order = order


def _fqns(name: str) -> list[str]:
    return [f"{name}.weight", f"{name}.bias"]


def _build(ctx, oracle, kwargs=None):
    kwargs = kwargs or {}
    plan = [(n, dict(kwargs)) for n in ("a", "b", "c")] + [("", dict(kwargs))]
    return ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=plan)


def _oracle(ctx, dims=(4, 4, 4, 4)):
    ctx.seed(0)
    return Ordered(dims).to(ctx.device)


def _batch(ctx, step):
    g = torch.Generator().manual_seed(410 + step)
    return torch.randn(ctx.world_size * B, 4, generator=g).to(ctx.device)


def _step(ctx, model, oracle, opts, step, what, in_forward=None, in_backward=None):
    """One SGD step on the global batch (the model's forward inside ``in_forward``, its backward
    inside ``in_backward``); the loss and parameters afterwards equal the oracle's."""
    x = _batch(ctx, step)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    with in_forward or contextlib.nullcontext():
        loss = model(x[mine]).square().mean()
    with in_backward or contextlib.nullcontext():
        loss.backward()
    oloss = oracle(x).square().mean(dim=1)
    oloss.mean().backward()
    assert_close(ctx, f"{what} step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
    for o in opts:
        o.step()
        o.zero_grad()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"{what} {name} after step {step}", got[name], ref, FP32["param"])


class _DetailDebug:
    """The distributed debug level DETAIL inside the block, the previous level restored after."""

    def __enter__(self):
        self.before = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.DETAIL)

    def __exit__(self, *exc):
        dist.set_debug_level(self.before)


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_EXEC_ORDER_CHECK},
    world_sizes=(2,),
)
def forward_order_differs_across_ranks(ctx):
    """R41: built under debug level DETAIL, a first training forward in which rank 0 runs units
    a, b, c and rank 1 runs b, a, c raises RuntimeError on every rank, before any unit's
    all-gather, saying "Forward order differs across ranks" and naming rank 0 with a's parameter
    FQNs and rank 1 with b's. Ranks with different units: when rank 1's model has a fourth unit
    d (registered after c) that it runs first while rank 0 runs a first, the first training
    forward raises it too, rank 0's naming rank 0 with a's FQNs and rank 1 with none (``[]``: d
    is not among rank 0's units), rank 1's naming rank 0 with a's and rank 1 with d's."""
    oracle = _oracle(ctx)
    with _DetailDebug():
        model = _build(ctx, oracle)
    _set_order(model, ("a", "b", "c") if ctx.rank == 0 else ("b", "a", "c"))
    unit_size = _flat_gather_numel(oracle.a, ctx.world_size)  # a, b and c alike
    spy = EventSpy({unit_size: "unit"}, products=("aten.addmm", "aten.mm"))
    try:
        with spy:
            model(_batch(ctx, 0)[:B])
    except RuntimeError as exc:
        text = str(exc)
    else:
        raise AssertionError(
            f"{ctx.where()} rank 0 ran a first and rank 1 ran b first under DETAIL: no error; "
            f"expected RuntimeError '{ORDER_TEXT} across ranks'"
        )
    assert "unit" not in spy.events, (
        f"{ctx.where()} a unit's parameters were all-gathered ({spy.events}) before the error"
    )
    assert f"{ORDER_TEXT} across ranks" in text, (
        f"{ctx.where()} RuntimeError {text!r} does not say '{ORDER_TEXT} across ranks'"
    )
    head, sep, tail = text.partition("rank 1")
    parts = {"rank 0": head, "rank 1": tail}
    wants = {"rank 0": ("a", "b"), "rank 1": ("b", "a")}
    for who, (gathers, other) in wants.items():
        part = parts[who]
        ok = sep and "rank 0" in head and all(f in part for f in _fqns(gathers))
        assert ok and not any(f in part for f in _fqns(other)), (
            f"{ctx.where()} RuntimeError {text!r}: expected {who} named with {_fqns(gathers)} "
            f"(the unit it gathers first), not {_fqns(other)}"
        )
    _extra_unit_on_rank1(ctx)


class _WithD(Ordered):
    """``Ordered`` with a fourth unit d, registered after c."""

    def __init__(self):
        super().__init__()
        self.d = nn.Linear(4, 4)


def _extra_unit_on_rank1(ctx) -> None:
    """R41's case of ranks with different units: rank 1 has d too and runs it first."""
    ctx.seed(0)
    extra = ctx.rank == 1
    model = (_WithD() if extra else Ordered()).to(ctx.device)
    names = ("a", "b", "c", "d") if extra else ("a", "b", "c")
    with _DetailDebug():
        model = ctx.impl.shard(model, ctx, plan=[(n, {}) for n in names] + [("", {})])
    _set_order(model, ("d", "a", "b", "c") if extra else ("a", "b", "c"))
    what = "rank 1 has a fourth unit d and runs it first, rank 0 runs a first"
    try:
        model(_batch(ctx, 0)[:B])
    except RuntimeError as exc:
        text = str(exc)
    else:
        raise AssertionError(f"{ctx.where()} {what}: no error; expected RuntimeError")
    head, sep, tail = text.partition("rank 1")
    ok = f"{ORDER_TEXT} across ranks" in text and sep and "rank 0" in head
    ok = ok and all(f in head for f in _fqns("a"))
    if extra:
        ok = ok and all(f in tail for f in _fqns("d"))
    else:
        ok = ok and tail.rstrip().endswith("parameters for []")
    assert ok, (
        f"{ctx.where()} {what}: RuntimeError {text!r}; expected '{ORDER_TEXT} across ranks' "
        f"naming rank 0 with {_fqns('a')} and rank 1 with "
        f"{_fqns('d') if extra else 'no parameters ([])'}"
    )


def _order_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if ORDER_TEXT in str(w.message)]


def _expect_warning(ctx, text, expected, met):
    """One deviation warning: names this rank, the unit expected (or none) and the unit met."""
    where = f"{ctx.where()} warning {text!r}"
    assert f"rank {ctx.rank}" in text, f"{where} does not name rank {ctx.rank}"
    head, sep, tail = text.partition("but trying to all-gather")
    if expected is None:
        assert "not all-gather any more parameters" in text, (
            f"{where}: expected it to say the first iteration gathered nothing more"
        )
        tail = text.partition("any more parameters")[2]
    else:
        assert sep and all(f in head for f in _fqns(expected)), (
            f"{where}: expected {_fqns(expected)} named as the unit expected"
        )
    assert all(f in tail for f in _fqns(met)), (
        f"{where}: expected {_fqns(met)} named as the unit met"
    )


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_EXEC_ORDER_CHECK},
    world_sizes=(2,),
)
def forward_order_changes_warn(ctx):
    """R42: built under debug level DETAIL, units run in the same order on every rank: step 0
    runs a, b (c unused) and step 1 the same, warning nothing; an eval forward running c, b
    warns nothing; step 2 runs a, c, b and warns twice on each rank (a as expected; expected b
    met c; nothing more expected met b), each warning naming the rank and the units' FQNs; step 3
    runs a, c, b again and warns nothing. Every step's loss and the parameters after it equal
    the unsharded model's (same orders, SGD on the global batch)."""
    oracle = _oracle(ctx)
    with _DetailDebug():
        model = _build(ctx, oracle)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    schedule = [  # (order, the warnings it must give: (unit expected or None, unit met))
        (("a", "b"), []),
        (("a", "b"), []),
        (("a", "c", "b"), [("b", "c"), (None, "b")]),
        (("a", "c", "b"), []),
    ]
    for step, (order, warns) in enumerate(schedule):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if warns:
                _set_order(model, ("c", "b"))
                model.eval()
                with torch.no_grad():
                    model(_batch(ctx, 9)[:B])
                model.train()
                got = _order_warnings(caught)
                assert not got, f"{ctx.where()} an eval forward in order c, b warned {got}"
            _set_order(model, order)
            oracle.order = order
            _step(ctx, model, oracle, opts, step, f"order {order}")
        got = _order_warnings(caught)
        assert len(got) == len(warns), (
            f"{ctx.where()} step {step} (order {order}; earlier steps "
            f"{[o for o, _ in schedule[:step]]}) warned {got}; expected {len(warns)} warning(s) "
            f"(expected unit, unit met): {warns}"
        )
        for text, (expected, met) in zip(got, warns):
            _expect_warning(ctx, text, expected, met)


def _flat_gather_numel(module: nn.Module, ws: int) -> int:
    """A unit's flat all-gather output size by R10: ``ws * ceil(N / ws)``."""
    n = sum(p.numel() for p in module.parameters())
    return ws * -(-n // ws)


# A Linear's forward is one addmm; its backward one mm for the weight's gradient and one for the
# input's when the input requires grad (a's input, the batch, does not).
FORWARD_MM = {"a": 1, "b": 1, "c": 1}
BACKWARD_MM = {"a": 1, "b": 2, "c": 2}


def _expected_events(order, prefetch: bool, products: dict[str, int]) -> list[str]:
    """By R43/R44, for units running (forward) or computing gradients (backward) in ``order``,
    unit u with ``products[u]`` matrix products: without prefetching each unit gathers, then
    computes; with it, a unit also gathers the next unit of ``order`` right after its own gather,
    before computing."""
    events: list[str] = []
    for i, unit in enumerate(order):
        if unit not in events:
            events.append(unit)
        if prefetch and i + 1 < len(order):
            events.append(order[i + 1])
        events += ["mm"] * products[unit]
    return events


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_PREFETCH},
    cases={"on": {"prefetch": True}, "off": {"prefetch": False}},
    world_sizes=(2,),
)
def prefetch_order(ctx, prefetch):
    """R43, R44: units a, b, c (4x4, 4x8, 8x2, resharded after forward) and a root without
    parameters, all built with ``forward_prefetch=True, backward_prefetch=BACKWARD_PRE`` (or
    False, None). Forward: the first gathers each unit right before its computation (a, mm, b,
    mm, c, mm); with prefetching the second gathers the next unit of the first forward's order
    right after a unit's own gather (a, b, mm, c, mm, mm). Backward (every step; c and b two
    products each, a one): with BACKWARD_PRE c, b, mm, mm, a, mm, mm, mm (the unit before in the
    forward gathered right after a unit's own), with None c, mm, mm, b, mm, mm, a, mm. Every
    unit is gathered once per pass; losses and parameters after two SGD steps equal the
    unsharded model's."""
    oracle = _oracle(ctx, dims=(4, 4, 8, 2))
    sizes = {_flat_gather_numel(getattr(oracle, n), ctx.world_size): n for n in "abc"}
    assert len(sizes) == 3, f"{ctx.where()} setup: two units gather the same size {sizes}"
    backward = ctx.impl.ns.BackwardPrefetch.BACKWARD_PRE if prefetch else None
    model = _build(ctx, oracle, {"forward_prefetch": prefetch, "backward_prefetch": backward})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    order = ("a", "b", "c")
    what = f"forward_prefetch={prefetch}, backward_prefetch={backward}"
    for step in range(2):
        products = ("aten.addmm", "aten.mm")
        fwd, bwd = EventSpy(sizes, products), EventSpy(sizes, products)
        _step(ctx, model, oracle, opts, step, what, fwd, bwd)
        for phase, spy, want in (
            ("forward", fwd, _expected_events(order, prefetch and step > 0, FORWARD_MM)),
            ("backward", bwd, _expected_events(order[::-1], prefetch, BACKWARD_MM)),
        ):
            assert spy.events == want, (
                f"{ctx.where()} {what} step {step}: {phase} events {spy.events}, expected {want}"
            )
