"""Area "training": a unit returning a view tensor (P84) and a unit recomputed in backward by
activation checkpointing (P85), also after the unit's post-backward resharded it (P130).

[Note: view outputs and recomputation]
P84: a tensor that requires grad and is a view (``t._base is not None``) among a unit's forward
outputs carries FSDP's pre-backward hook, which an in-place op on the view would drop. With grad
enabled FSDP2 says so once per such tensor per forward with a ``UserWarning`` whose text starts
``FSDP2-wrapped module (<names>) returned a view tensor``, ``<names>`` naming the class of every
module of the unit, in the order the unit was given (``fully_shard([a, b])``: both, joined by
``", "``; an implementation may name its FSDP subclass of the class, ``FSDPFold`` for ``Fold``,
so each entry must contain the class's name). Only the stable prefix and the names are judged,
not the advice after them. Under ``torch.no_grad()`` nothing is hooked and nothing is said. The
warning changes nothing: used out of place, the view trains like the unsharded model (the
``_shared/oracle.py`` rule: rank r feeds its ``B`` samples, the oracle the global batch).

P85: a unit run inside non-reentrant ``torch.utils.checkpoint.checkpoint`` runs forward a second
time during backward (the recomputation) while FSDP is in backward. The recomputation must see what
the forward saw: parameters unsharded, and forward inputs cast as the unit's mixed-precision
policy says (``cast_forward_inputs=True`` with ``param_dtype``), so a unit of
``param_dtype=bf16`` called on an fp32 activation recomputes from a bf16 input, or the recomputed
tensors no longer match the saved ones and backward fails. Gradients then equal the unsharded
model's: without a policy within fp32 tolerance; with ``param_dtype=bf16`` (``reduce_dtype``
None: the gradient is reduced in bf16, P5) against the oracle computing that layer in bf16 (its
parameters and its input cast to bf16), within the bf16 tolerances of the oracle's mixed-precision
rule (``rtol=2e-2``; ``atol=1e-3`` on outputs and losses, ``2e-3`` on gradients).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, B, assert_close, backward_and_compare
from conformance.registry import check

BF16 = torch.bfloat16
BF16_TOL = {"out": dict(rtol=2e-2, atol=1e-3), "grad": dict(rtol=2e-2, atol=2e-3)}
REQUIRES = {base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING}


# ---------------------------------------------------------------------------- P84: view outputs
class Lift(nn.Module):
    """Linear(5, 6) -> tanh (a fresh tensor, not a view)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Fold(nn.Module):
    """Linear(6, 6) returned as a (n, 2, 3) view of its output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h):
        return self.lin(h).view(-1, 2, 3)


class Viewing(nn.Module):
    """``b(a(x))`` summed over its middle dim (out of place: the root returns no view)."""

    def __init__(self):
        super().__init__()
        self.a = Lift()
        self.b = Fold()

    def forward(self, x):
        return self.b(self.a(x)).sum(dim=1)


VIEW_WARNING = re.compile(r"FSDP2-wrapped module \(([^)]*)\) returned a view tensor")
UNITS = {"single": ("b",), "grouped": ("a", "b")}


def _view_warnings(record) -> list[str]:
    return [
        str(w.message)
        for w in record
        if issubclass(w.category, UserWarning) and "returned a view tensor" in str(w.message)
    ]


def _assert_names(ctx, text: str, expected: list[str]) -> None:
    match = VIEW_WARNING.search(text)
    assert match, (
        f"{ctx.where()} the view warning {text!r} does not start "
        "'FSDP2-wrapped module (<names>) returned a view tensor'"
    )
    named = match.group(1).split(", ")
    assert len(named) == len(expected) and all(
        want in got for want, got in zip(expected, named, strict=True)
    ), (
        f"{ctx.where()} the view warning names ({match.group(1)}); expected the unit's module "
        f"classes in order: ({', '.join(expected)})"
    )


@check(area="training", requires=REQUIRES, cases={k: {"unit": k} for k in UNITS})
def view_output_warning(ctx, unit):
    """P84: a unit whose forward returns a view that requires grad (``Fold``: ``lin(h).view(-1,
    2, 3)``; ``single``: ``fully_shard(b)``, ``grouped``: ``fully_shard([a, b])`` with ``a`` a
    ``Lift``; the root over them returns no view) warns once per grad-enabled forward with a
    ``UserWarning`` starting ``FSDP2-wrapped module (<names>) returned a view tensor``, the names
    being the unit's module classes in order (``Fold``; ``Lift, Fold``), and not at all under
    ``torch.no_grad()``; over 2 SGD steps the losses, sharded gradients and parameters equal the
    unsharded model's."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = Viewing().to(ctx.device)
    oracle = copy.deepcopy(model)
    members = [model.get_submodule(name) for name in UNITS[unit]]
    expected = [type(m).__name__ for m in members]
    ns.fully_shard(members[0] if len(members) == 1 else members, mesh=ctx.mesh)
    ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        g = torch.Generator().manual_seed(8400 + step)
        n = ctx.world_size * B
        x = torch.randn(n, 5, generator=g).to(ctx.device)
        y = torch.randn(n, 3, generator=g).to(ctx.device)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = model(x[mine])
        said = _view_warnings(record)
        assert len(said) == 1, (
            f"{ctx.where()} step {step}: a grad-enabled forward whose unit returns one view "
            f"raised {len(said)} view warnings, expected exactly 1: {said}"
        )
        _assert_names(ctx, said[0], expected)
        backward_and_compare(ctx, model, oracle, (out, oracle(x), y, mine), (opt, oopt), step)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            quiet = model(x[mine])
    said = _view_warnings(record)
    assert not said, f"{ctx.where()} a forward under torch.no_grad() warned: {said}"
    assert_close(ctx, "no_grad output", quiet, oracle(x)[mine], FP32["loss"])


# ----------------------------------------------------------------------- P85: recomputation
class Seen(nn.Linear):
    """Linear(4, 4) recording the dtypes of its input and weight at every forward call."""

    def __init__(self):
        super().__init__(4, 4)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x):
        self.seen.append((x.dtype, self.weight.dtype))
        return super().forward(x)


class Recomputed(nn.Module):
    """``checkpoint(l0, l1(x).float(), use_reentrant=False)``; ``cast`` (the oracle's, None in the
    sharded model) casts ``l0``'s input itself."""

    def __init__(self):
        super().__init__()
        self.l0 = Seen()
        self.l1 = nn.Linear(4, 4)
        self.cast: torch.dtype | None = None

    def forward(self, x):
        h = self.l1(x).float()
        if self.cast is not None:
            h = h.to(self.cast)
        return checkpoint(self.l0, h, use_reentrant=False)


def _batch(ctx, step):
    g = torch.Generator().manual_seed(8500 + step)
    n = ctx.world_size * B
    return torch.randn(n, 4, generator=g).to(ctx.device), torch.randn(n, 4, generator=g).to(
        ctx.device
    )


def _backward(ctx, loss, what):
    try:
        loss.backward()
    except Exception as exc:  # the recomputation's mismatch surfaces as a CheckpointError
        raise AssertionError(
            f"{ctx.where()} {what}: backward through the recomputed unit raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _two_sgd_steps(ctx, module, unit, after_step=None):
    """``module.<unit>`` and ``module`` sharded as units (seed 0), then two SGD steps (lr 0.1)
    against the unsharded copy, compared by ``backward_and_compare``; ``after_step(model, step)``
    runs after each step."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = module.to(ctx.device)
    oracle = copy.deepcopy(model)
    ns.fully_shard(getattr(model, unit), mesh=ctx.mesh)
    ns.fully_shard(model, mesh=ctx.mesh)
    opts = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(oracle.parameters(), lr=0.1),
    )
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    for step in range(2):
        x, y = _batch(ctx, step)
        backward_and_compare(ctx, model, oracle, (model(x[mine]), oracle(x), y, mine), opts, step)
        if after_step is not None:
            after_step(model, step)


@check(area="training", requires=REQUIRES)
def recompute_unit(ctx):
    """P85: a unit ``l0`` run inside non-reentrant ``checkpoint`` under a root unit (no mixed
    precision) is recomputed in backward from unsharded parameters (it runs twice per step,
    seeing fp32 inputs and weights); over 2 SGD steps the losses, sharded gradients and parameters
    equal the unsharded model's."""
    fp32 = (torch.float32, torch.float32)

    def ran_twice_in_fp32(model, step):
        assert model.l0.seen == [fp32, fp32], (
            f"{ctx.where()} step {step}: l0 ran with (input, weight) dtypes {model.l0.seen}; "
            "expected the forward and its recomputation, both fp32"
        )
        model.l0.seen.clear()

    _two_sgd_steps(ctx, Recomputed(), "l0", after_step=ran_twice_in_fp32)


def _compare_grads(ctx, model, oracle, what, tol):
    """Every sharded parameter's gradient is a DTensor of the parameter's dtype whose
    ``full_tensor()`` equals the oracle's gradient (mean over the global batch)."""
    from torch.distributed.tensor import DTensor

    for fqn, param in model.named_parameters():
        ograd = oracle.get_parameter(fqn).grad
        grad = param.grad
        assert isinstance(grad, DTensor) and grad.dtype == param.dtype, (
            f"{ctx.where()} {what} {fqn}: gradient {type(grad).__name__} "
            f"{getattr(grad, 'dtype', None)}, expected a DTensor of {param.dtype}"
        )
        assert_close(ctx, f"{what} {fqn} gradient (full_tensor)", grad.full_tensor(), ograd, tol)


@check(area="training", requires=REQUIRES | {base.MIXED_PRECISION})
def recompute_unit_casts_inputs(ctx):
    """P85, P5: a unit ``l0`` of ``param_dtype=bf16`` run inside non-reentrant ``checkpoint`` on
    an fp32 activation (under a root unit without a policy) sees a bf16 input and bf16 weights in
    its forward and again in its recomputation, backward succeeds, and the output, loss and fp32
    sharded gradients (``full_tensor()``) equal the unsharded model computing ``l0`` in bf16
    (parameters and input cast) within bf16 tolerances."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = Recomputed().to(ctx.device)
    oracle = copy.deepcopy(model)
    oracle.l0.to(BF16)
    oracle.cast = BF16
    ns.fully_shard(model.l0, mesh=ctx.mesh, mp_policy=ns.MixedPrecisionPolicy(param_dtype=BF16))
    ns.fully_shard(model, mesh=ctx.mesh)
    _bf16_step(ctx, model, oracle, BF16, "param_dtype=bf16")
    assert model.l0.seen == [(BF16, BF16), (BF16, BF16)], (
        f"{ctx.where()} l0 ran with (input, weight) dtypes {model.l0.seen}; expected the forward "
        "and its recomputation, both with the fp32 input cast to bf16 and bf16 weights"
    )


def _bf16_step(ctx, model, oracle, out_dtype, what: str) -> None:
    """One forward/backward of ``model`` on this rank's samples against ``oracle`` (computing the
    bf16 unit in bf16) on the global batch: the output has ``out_dtype`` and, with the loss and
    the fp32 sharded gradients, equals the oracle's within bf16 tolerances."""
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    x, y = _batch(ctx, 0)
    out, oout = model(x[mine]), oracle(x)
    assert out.dtype == out_dtype, f"{ctx.where()} output dtype {out.dtype}, expected {out_dtype}"
    assert_close(ctx, "output", out, oout[mine], BF16_TOL["out"])
    loss = ((out.float() - y[mine]) ** 2).mean()
    oloss = ((oout.float() - y) ** 2).mean(dim=1)
    assert_close(ctx, "loss", loss, oloss[mine].mean(), BF16_TOL["out"])
    _backward(ctx, loss, what)
    oloss.mean().backward()
    _compare_grads(ctx, model, oracle, what, BF16_TOL["grad"])


class TwiceRecomputed(nn.Module):
    """The unit ``u`` used twice, each use inside its own non-reentrant ``checkpoint`` region
    that also holds a plain layer after it: ``x -> [u -> tanh -> a] -> [u -> tanh -> b]``;
    ``cast`` (the oracle's, None in the sharded model) runs ``u`` on its input cast to that dtype
    and casts its output back to fp32."""

    def __init__(self):
        super().__init__()
        self.u = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.cast: torch.dtype | None = None

    def _region(self, x, after):
        h = self.u(x) if self.cast is None else self.u(x.to(self.cast)).float()
        return after(torch.tanh(h))

    def forward(self, x):
        h = checkpoint(self._region, x, self.a, use_reentrant=False)
        return checkpoint(self._region, h, self.b, use_reentrant=False)


@check(area="training", requires=REQUIRES)
def recompute_after_unit_backward(ctx):
    """P130: a unit ``u`` used twice in one forward, each use recomputed by non-reentrant
    ``checkpoint`` in a region that ends in a plain layer (``TwiceRecomputed``), under a root
    unit: in backward the second region is recomputed and its gradients reach ``u``, whose
    post-backward frees its unsharded parameters; the first region is recomputed next, before
    any gradient reaches ``u``'s output of that use, so ``u`` must be unsharded again for that
    recomputation. Over 2 SGD steps the losses, sharded gradients (``u``'s the sum of both uses')
    and parameters equal the unsharded model's (``backward_and_compare``)."""
    _two_sgd_steps(ctx, TwiceRecomputed(), "u")


@check(area="training", requires=REQUIRES | {base.MIXED_PRECISION})
def recompute_after_unit_backward_output_dtype(ctx):
    """P130, P5: as ``recompute_after_unit_backward`` with ``u`` of ``MixedPrecisionPolicy(
    param_dtype=bf16, output_dtype=fp32)``: each recomputation of ``u`` (the second region's
    and, after ``u``'s post-backward, the first's) returns the fp32 output the forward returned,
    or the recomputed activations no longer match the saved ones; backward succeeds and the output,
    loss and fp32 sharded gradients (``full_tensor()``) equal the unsharded model computing ``u``
    in bf16 (its parameters and input cast, its output cast back to fp32) within bf16 tolerances."""
    ns = ctx.impl.ns
    ctx.seed(0)
    model = TwiceRecomputed().to(ctx.device)
    oracle = copy.deepcopy(model)
    oracle.u.to(BF16)
    oracle.cast = BF16
    policy = ns.MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32)
    ns.fully_shard(model.u, mesh=ctx.mesh, mp_policy=policy)
    ns.fully_shard(model, mesh=ctx.mesh)
    _bf16_step(
        ctx,
        model,
        oracle,
        torch.float32,
        "u of param_dtype=bf16, output_dtype=fp32 recomputed twice",
    )
