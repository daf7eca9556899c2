"""Area "fsdp1_runtime": ``FullyShardedDataParallel.summon_full_params`` and its options (R3-R5),
and what a unit refuses while inside it (R56, R90).

[Note: the summon rules]
``summon_full_params(module, recurse=True, writeback=True, rank0_only=False, offload_to_cpu=False,
with_grads=False)`` is a context every rank enters. Inside it, every original parameter of the
FSDP units it covers is visible under its original name with its full shape and the full values
(``recurse=False``: only ``module`` 's own unit; a unit it does not cover keeps its sharded
parameters). On exit the parameters are sharded again and:
* ``writeback=True``: changes made inside persist (each rank keeps its own range; here every rank
  makes the same change, so the full parameter is the changed one);
* ``writeback=False``: changes are discarded, except where FSDP does not shard (world size 1,
  NO_SHARD), where the full parameter *is* the storage and changes persist regardless;
* ``rank0_only=True``: only rank 0 sees full parameters; the other ranks see exactly what they
  saw before entering (their sharded parameters);
* ``offload_to_cpu=True``: the full parameters live on the CPU; with ``rank0_only=False`` a
  UserWarning recommends ``rank0_only=True``;
* ``with_grads=True`` (``use_orig_params=True`` only): every parameter's ``.grad`` is its full
  gradient, and on exit the sharded gradients are as before.
Refusals, before any change (upstream's types and texts): ``writeback=True`` with
``rank0_only=True`` → NotImplementedError "writeback=True and rank0_only=True is not supported
yet"; ``offload_to_cpu=True`` on a unit that does not shard → NotImplementedError
"offload_to_cpu=True and NO_SHARD is not supported yet"; ``with_grads=True`` with
``use_orig_params=False`` or ``offload_to_cpu=True`` → NotImplementedError "with_grads=True,
use_orig_params=..., offload_to_cpu=... is not supported yet"; entering it again on a unit already
inside → AssertionError "Cannot manually unshard parameters when already unsharding parameters".
The model: ``inner`` Linear(5, 7) is its own unit, the root owns ``head`` Linear(7, 3) (uneven at
every world size above 1). Expected values come from the unsharded copy taken before sharding.

[Note: a unit inside summon_full_params is not idle]
A backward through a unit while it is inside ``summon_full_params`` is refused with ValueError
saying the unit is expected to be IDLE but is in ``SUMMON_FULL_PARAMS`` (R90); the root's
``clip_grad_norm_`` and ``no_sync()`` are refused there the same way and change no gradient (R56).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES as FSDP1_REQUIRES
from conformance.checks._shared.fsdp1_setup import _global_batch
from conformance.checks._shared.models import expect_error
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_RUNTIME}
PLAN = [("inner", {}), ("", {})]
ORIG = {"flat": {"orig": False}, "orig-params": {"orig": True}}


class TwoUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


def build(ctx, orig: bool):
    """(sharded model, its unsharded copy, FSDP class)."""
    ctx.seed(0)
    model = TwoUnits().to(ctx.device)
    oracle = copy.deepcopy(model)
    sharded = ctx.impl.shard(model, ctx, plan=PLAN, use_orig_params=orig)
    return sharded, oracle, ctx.impl.ns.FullyShardedDataParallel


def visible(ctx, model) -> dict[str, nn.Parameter]:
    return {ctx.impl.clean_fqn(n): p for n, p in model.named_parameters()}


def shapes(ctx, model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in visible(ctx, model).items()}


def assert_full(ctx, model, oracle, what: str, names=None, device=None) -> None:
    """The named parameters (default: all) are visible with full shapes and the oracle's values."""
    got = visible(ctx, model)
    for name, ref in oracle.named_parameters():
        if names is not None and name not in names:
            continue
        assert name in got, f"{ctx.where()} {what}: {name} not visible ({sorted(got)})"
        assert_close(ctx, f"{what}: {name}", got[name], ref, FP32["param"])
        if device is not None:
            assert got[name].device.type == device, (
                f"{ctx.where()} {what}: {name} on {got[name].device}, expected {device}"
            )


def change(ctx, model) -> None:
    """The same in-place change on every rank: p -> 1 - 2p."""
    with torch.no_grad():
        for p in visible(ctx, model).values():
            p.mul_(-2.0).add_(1.0)


def changed(oracle) -> dict[str, torch.Tensor]:
    return {n: 1.0 - 2.0 * p.detach() for n, p in oracle.named_parameters()}


def assert_params(ctx, model, want: dict, what: str) -> None:
    """After the context: the sharded parameters, reassembled, equal ``want``."""
    got = full_params(ctx, model)
    for name, value in want.items():
        assert_close(ctx, f"{what}: {name}", got[name], value, FP32["param"])


def expect_refusal(ctx, what: str, exc_type, pattern: str, enter) -> None:
    try:
        with enter():
            pass
    except exc_type as exc:
        assert re.search(pattern, str(exc)), (
            f"{ctx.where()} {what}: {exc_type.__name__} {str(exc)!r} does not say {pattern!r}"
        )
        return
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} {what}: raised {type(exc).__name__}: {exc}, expected "
            f"{exc_type.__name__} matching {pattern!r}"
        ) from exc
    raise AssertionError(f"{ctx.where()} {what}: accepted; expected {exc_type.__name__}")


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={
        f"{k}-writeback-{wb}".lower(): {**v, "writeback": wb}
        for k, v in ORIG.items()
        for wb in (True, False)
    },
)
def summon_writeback(ctx, orig, writeback):
    """R3: inside ``summon_full_params(model, writeback=...)`` every parameter is visible with its
    full shape and values; a change made inside persists after exit with ``writeback=True``, and
    with ``writeback=False`` is discarded (kept where nothing is sharded: world size 1); the
    model then runs forward on the kept values."""
    model, oracle, FSDP = build(ctx, orig)
    with FSDP.summon_full_params(model, writeback=writeback):
        assert_full(ctx, model, oracle, f"inside summon(writeback={writeback})")
        change(ctx, model)
    kept = writeback or ctx.world_size == 1
    want = changed(oracle) if kept else dict(oracle.named_parameters())
    assert_params(ctx, model, want, f"after summon(writeback={writeback})")
    if kept:
        with torch.no_grad():
            for name, p in oracle.named_parameters():
                p.copy_(want[name])
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7)).to(ctx.device)
    assert_close(ctx, "forward after summon", model(x), oracle(x), FP32["loss"])


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def summon_rank0_only(ctx, orig):
    """R4: ``rank0_only=True`` with ``writeback=True`` is refused (NotImplementedError); with
    ``writeback=False`` rank 0 sees the full parameters and every other rank exactly what it saw
    before entering; rank 0's change inside is discarded on exit (kept at world size 1, where
    nothing is sharded)."""
    model, oracle, FSDP = build(ctx, orig)
    expect_refusal(
        ctx,
        "summon(rank0_only=True, writeback=True)",
        NotImplementedError,
        "writeback=True and rank0_only=True is not supported yet",
        lambda: FSDP.summon_full_params(model, rank0_only=True, writeback=True),
    )
    before = shapes(ctx, model)
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        if ctx.rank == 0:
            assert_full(ctx, model, oracle, "inside summon(rank0_only=True) on rank 0")
            change(ctx, model)
        else:
            inside = shapes(ctx, model)
            assert inside == before, (
                f"{ctx.where()} inside summon(rank0_only=True) a rank other than 0 sees {inside}, "
                f"expected what it saw before ({before})"
            )
    # rank 0's change is discarded, except where nothing is sharded (world size 1)
    want = changed(oracle) if ctx.world_size == 1 else dict(oracle.named_parameters())
    assert_params(ctx, model, want, "after summon(rank0_only=True)")


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG, world_sizes=(1,))
def summon_offload_to_cpu_no_shard(ctx, orig):
    """R4: ``offload_to_cpu=True`` on units that do not shard (world size 1: NO_SHARD) is refused
    with NotImplementedError "offload_to_cpu=True and NO_SHARD is not supported yet"."""
    model, _, FSDP = build(ctx, orig)
    expect_refusal(
        ctx,
        "summon(offload_to_cpu=True) at world size 1",
        NotImplementedError,
        "offload_to_cpu=True and NO_SHARD is not supported yet",
        lambda: FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False),
    )


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG, min_world_size=2)
def summon_offload_to_cpu(ctx, orig):
    """R4: with sharded units, ``offload_to_cpu=True`` gives full parameters on the CPU with the
    full values (rank 0 only with ``rank0_only=True``), ``rank0_only=False`` warns (a UserWarning
    recommending ``rank0_only=True``), and the model keeps its values after exit."""
    model, oracle, FSDP = build(ctx, orig)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False):
            assert_full(ctx, model, oracle, "inside summon(offload_to_cpu=True)", device="cpu")
    warned = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert any("rank0_only" in m for m in warned), (
        f"{ctx.where()} summon(offload_to_cpu=True, rank0_only=False) gave no UserWarning "
        f"recommending rank0_only=True (warnings: {warned})"
    )
    with FSDP.summon_full_params(model, offload_to_cpu=True, rank0_only=True, writeback=False):
        if ctx.rank == 0:
            assert_full(
                ctx, model, oracle, "inside summon(offload_to_cpu, rank0_only)", device="cpu"
            )
    assert_params(ctx, model, dict(oracle.named_parameters()), "after summon(offload_to_cpu)")


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, cases=ORIG)
def summon_with_grads(ctx, orig):
    """R4: ``with_grads=True`` is refused with ``use_orig_params=False`` or ``offload_to_cpu=True``
    (NotImplementedError "with_grads=True, use_orig_params=..., offload_to_cpu=..."); with
    ``use_orig_params=True`` every parameter's ``.grad`` inside is the full gradient (the
    unsharded model's on the same global batch), and after exit the sharded gradients are
    unchanged; with ``rank0_only=True`` too, rank 0 seeing the full gradients and every other rank
    the sharded ones it had. R58: after ``model.zero_grad(set_to_none=True)`` every ``.grad`` inside
    ``summon_full_params(with_grads=True)`` is None, and after every rank assigns each parameter's
    (sharded) ``.grad`` a tensor of 3s, every full ``.grad`` inside is 3s."""
    model, oracle, FSDP = build(ctx, orig)
    x = torch.randn(2 * ctx.world_size, 5, generator=torch.Generator().manual_seed(3))
    x = x.to(ctx.device)
    mine = x[2 * ctx.rank : 2 * ctx.rank + 2]
    model(mine).pow(2).mean().backward()
    oracle(x).pow(2).mean().backward()
    if not orig:
        expect_refusal(
            ctx,
            "summon(with_grads=True) with use_orig_params=False",
            NotImplementedError,
            r"with_grads=True, use_orig_params=False, offload_to_cpu=False is not supported",
            lambda: FSDP.summon_full_params(model, with_grads=True),
        )
        return
    expect_refusal(
        ctx,
        "summon(with_grads=True, offload_to_cpu=True)",
        NotImplementedError,
        r"with_grads=True, use_orig_params=True, offload_to_cpu=True is not supported",
        lambda: FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=True),
    )
    before = {n: None if p.grad is None else p.grad.clone() for n, p in visible(ctx, model).items()}
    with FSDP.summon_full_params(model, with_grads=True):
        got = visible(ctx, model)
        for name, ref in oracle.named_parameters():
            grad = got[name].grad
            assert grad is not None, f"{ctx.where()} inside summon(with_grads): {name}.grad is None"
            assert_close(
                ctx, f"inside summon(with_grads): {name}.grad", grad, ref.grad, FP32["grad"]
            )
    for name, p in visible(ctx, model).items():
        old = before[name]
        assert (p.grad is None) == (old is None), (
            f"{ctx.where()} after summon(with_grads): {name}.grad is {p.grad}, before it was {old}"
        )
        if old is not None:
            assert_close(ctx, f"after summon(with_grads): {name}.grad", p.grad, old, FP32["grad"])
    # rank0_only: rank 0 sees the full gradients, every other rank what it had before
    with FSDP.summon_full_params(model, with_grads=True, rank0_only=True, writeback=False):
        got = visible(ctx, model)
        for name, ref in oracle.named_parameters():
            grad, what = got[name].grad, f"inside summon(with_grads, rank0_only): {name}.grad"
            want = ref.grad if ctx.rank == 0 else before[name]
            assert (grad is None) == (want is None), f"{ctx.where()} {what} is {grad}"
            if want is not None:
                assert_close(ctx, what, grad, want, FP32["grad"])
    model.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model, with_grads=True):
        stale = {n: p.grad for n, p in visible(ctx, model).items() if p.grad is not None}
    assert not stale, (
        f"{ctx.where()} after zero_grad(set_to_none=True), summon(with_grads) shows gradients for "
        f"{sorted(stale)}; expected every .grad None (R58)"
    )
    # R4: a gradient the user assigns (to each rank's sharded view) counts as the gradient
    for p in visible(ctx, model).values():
        p.grad = torch.full_like(p, 3.0)
    with FSDP.summon_full_params(model, with_grads=True):
        got = visible(ctx, model)
        for name, ref in oracle.named_parameters():
            grad, what = got[name].grad, "inside summon(with_grads) after assigning .grad = 3"
            assert grad is not None, f"{ctx.where()} {what}: {name}.grad is None"
            assert_close(ctx, f"{what}: {name}.grad", grad, torch.full_like(ref, 3.0), FP32["grad"])


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def summon_nested(ctx, orig):
    """R5: ``summon_full_params(model, recurse=False)`` unshards only the root's own unit (``head``
    full, ``inner`` as before); a nested ``summon_full_params(inner unit)`` inside it unshards
    ``inner`` too; entering it again on the root while inside raises AssertionError "Cannot
    manually unshard parameters when already unsharding parameters"; after both exits every
    parameter is sharded with its original values."""
    model, oracle, FSDP = build(ctx, orig)
    inner = next(m for n, m in model.named_modules() if n and isinstance(m, FSDP))
    before = shapes(ctx, model)
    inner_before = {n: s for n, s in before.items() if n.startswith("inner")}
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        assert_full(
            ctx, model, oracle, "inside summon(root, recurse=False)", {"head.weight", "head.bias"}
        )
        inside = {n: s for n, s in shapes(ctx, model).items() if n.startswith("inner")}
        assert inside == inner_before, (
            f"{ctx.where()} inside summon(root, recurse=False) the inner unit shows {inside}, "
            f"expected its sharded parameters as before ({inner_before})"
        )
        expect_refusal(
            ctx,
            "summon(root) inside summon(root)",
            AssertionError,
            "already unsharding",
            lambda: FSDP.summon_full_params(model, writeback=False),
        )
        with FSDP.summon_full_params(inner, writeback=False):
            assert_full(
                ctx, model, oracle, "inside summon(inner) inside summon(root, recurse=False)"
            )
    after = shapes(ctx, model)
    assert after == before, f"{ctx.where()} after the nested summons: {after}, before: {before}"
    assert_params(ctx, model, dict(oracle.named_parameters()), "after the nested summons")


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG)
def summon_non_fsdp_module(ctx, orig):
    """R3: ``summon_full_params`` on a module that is not FSDP itself (a ModuleDict holding the
    sharded model) unshards every FSDP unit inside it: all parameters full inside, and a change
    made inside persists with ``writeback=True``."""
    ctx.seed(0)
    part = TwoUnits().to(ctx.device)
    oracle = nn.ModuleDict({"part": copy.deepcopy(part)})
    holder = nn.ModuleDict({"part": ctx.impl.shard(part, ctx, plan=PLAN, use_orig_params=orig)})
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    with FSDP.summon_full_params(holder):
        assert_full(ctx, holder, oracle, "inside summon(non-FSDP holder)")
        change(ctx, holder)
    assert_params(ctx, holder, changed(oracle), "after summon(non-FSDP holder, writeback=True)")


class _ChildHead(nn.Module):
    """head(tanh(child(x))): ``child`` a ``Linear(4, 4)``, ``head`` a ``Linear(4, 2)``."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.child(x)))


# ------------------------------------------------------------------------------ R90
@check(area="fsdp1_runtime", requires=FSDP1_REQUIRES | {base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def backward_inside_summon_refused(ctx):
    """R90: units ``child`` and the root over ``head(tanh(child(x)))``; after a forward (the same
    batch on every rank), a backward of its output run inside ``summon_full_params(model.child)``
    raises on every rank ValueError "expected to be in states [...IDLE...] but current state is
    ...SUMMON_FULL_PARAMS"; after the context exits, a forward still equals the unsharded
    model's."""
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    ctx.seed(0)
    oracle = _ChildHead().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("child", {}), ("", {})])
    x = _global_batch(ctx, 90)
    out = model(x)

    def backward_in_summon():
        with fsdp.summon_full_params(model.module.child):
            out.sum().backward()

    expect_error(
        ctx,
        "backward inside summon_full_params(child)",
        ValueError,
        r"(?s)expected to be in states.*IDLE.*current state is.*SUMMON_FULL_PARAMS",
        backward_in_summon,
    )
    with torch.no_grad():
        assert_close(ctx, "forward after the refused backward", model(x), oracle(x), FP32["loss"])


@check(area="fsdp1_runtime", requires={base.FLAT_PARAM, base.FSDP1_RUNTIME}, world_sizes=(1, 2))
def root_calls_refused_inside_summon(ctx):
    """R56: inside ``summon_full_params`` on the root (``InnerHeadNet``, ``inner`` its own unit,
    after one forward and backward), ``root.clip_grad_norm_(0.01)`` and entering
    ``root.no_sync()`` are refused with ValueError "expected to be in states"; nothing is
    clipped: after exit the full gradients equal the unsharded model's."""
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = ctx.impl.shard(copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})])
    x = torch.randn(ctx.world_size * B, 4, generator=torch.Generator().manual_seed(9))
    x = x.to(ctx.device)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    (model(x[mine]) ** 2).sum().div(B).backward()
    (oracle(x) ** 2).sum().div(ctx.world_size * B).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    def enter_no_sync():
        with model.no_sync():
            pass

    with ctx.impl.FSDP.summon_full_params(model):
        for what, call in (
            ("clip_grad_norm_", lambda: model.clip_grad_norm_(0.01)),
            ("no_sync()", enter_no_sync),
        ):
            expect_error(
                ctx,
                f"{what} inside summon_full_params",
                ValueError,
                "expected to be in states",
                call,
            )
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), f"{ctx.where()} {name}: gradient changed"
    total = model.clip_grad_norm_(1e6)  # accepted again after exit; nothing clipped
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e6)
    assert_close(ctx, "clip_grad_norm_ after exit", total, ref, FP32["grad"])
