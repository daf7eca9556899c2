"""Area "fsdp1_runtime": what ``use_orig_params=True`` promises about the original parameters'
values and gradients around the flat parameter (R45-R49, R59).

[Note: the original parameters are the user's]
With ``use_orig_params=True`` the user sees, and may change, the original Parameter objects; FSDP1
keeps the flat parameter in step with them. So each rule here is the unsharded model's own
behaviour seen through the sharding:
* a ``.grad`` the user set to None counts as zero: the next backward gives that parameter only the
  new gradient, the others the sum (plain autograd accumulation);
* a ``.data`` replaced by a tensor of another shape cannot be written back: the next forward
  raises RuntimeError "Cannot writeback when the parameter shape changes" (a gradient whose
  ``.data`` was so replaced: "... the gradient shape changes");
* a strategy that keeps the parameters gathered after forward (SHARD_GRAD_OP) still trains like
  the unsharded model, and refuses a ``.data`` replaced between forward and backward
  (AssertionError "... does not support changing the parameters between forward and backward");
* ``summon_full_params(with_grads=True)`` shows each parameter's full gradient, None where none
  was computed yet, also under NO_SHARD and for a parameter registered under two names;
* ``model.to(dtype)`` after wrapping converts the flat parameter and so every original
  parameter: training then runs in that dtype like the unsharded model converted alike;
* optimizers applied in backward to the original parameters step them during each backward as
  the unsharded model's optimizer steps it after each backward.
The model is ``TwoUnits`` (``inner`` its own unit, the root owning ``head``). Each rank feeds its
own two samples of one global batch; its loss is the sum over its samples divided by the global
batch size times the world size, so the averaged gradient is the oracle's on the global batch.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import full_params
from conformance.checks.fsdp1.summon_full_params import TwoUnits, visible
from conformance.checks.fsdp1.training import assert_orig_param_grads
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_RUNTIME, base.TRAINING}
B = 2  # samples per rank
ORIG = {"flat": {"orig": False}, "orig-params": {"orig": True}}
FP64 = dict(rtol=1e-10, atol=1e-12)  # float64 computed and reduced in float64
BF16_TOL = dict(rtol=3e-2, atol=3e-3)  # bf16 compute and gradients (R6)


def _build(ctx, strategy: str | None = None, model: nn.Module | None = None):
    """(sharded model, unsharded copy): ``inner`` its own unit, both units ``strategy``."""
    ctx.seed(0)
    model = (model or TwoUnits()).to(ctx.device)
    oracle = copy.deepcopy(model)
    extra = (
        {}
        if strategy is None
        else {"sharding_strategy": getattr(ctx.impl.ns.ShardingStrategy, strategy)}
    )
    plan = [("inner", {}), ("", extra)]
    return ctx.impl.shard(model, ctx, plan=plan, use_orig_params=True), oracle


def _batch(ctx, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B * ctx.world_size, 5, generator=g).to(ctx.device, dtype)
    return x, x[B * ctx.rank : B * (ctx.rank + 1)]


def _loss(out: torch.Tensor, ws: int) -> torch.Tensor:
    """Sum of squares over ``ws`` ranks' worth of samples, scaled so the rank average (FSDP's
    reduction) of the local losses' gradients is the global loss's gradient."""
    return out.square().sum() / (B * ws)


def _step(ctx, model, oracle, step: int) -> None:
    """One forward and backward of the sharded model (own samples) and the oracle (all)."""
    x, mine = _batch(ctx, step)
    _loss(model(mine), 1).backward()
    _loss(oracle(x), ctx.world_size).backward()


def _named(ctx, model) -> dict[str, nn.Parameter]:
    return visible(ctx, model)


# ------------------------------------------------------------------------------ R45
@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"full-shard": {"strategy": None}, "no-shard": {"strategy": "NO_SHARD"}},
    world_sizes=(1, 2),
)
def orig_params_grad_set_to_none(ctx, strategy):
    """R45: the user's ``.grad`` is what the next backward accumulates onto. After a backward the
    user sets ``.grad = None`` on two original parameters (one of the nested unit, one of the
    root) and assigns ``inner.weight.grad`` a new tensor of 0.5s, then runs another forward and
    backward without zeroing: between that forward and its backward the two still have no
    gradient; after it they hold only the second backward's gradient, ``inner.weight`` 0.5 plus
    it, every other parameter the sum of both backwards (``head.bias`` also the 0.25s assigned
    to it before the first backward). Then, after ``zero_grad()`` (every
    ``.grad`` None), ``head.bias.grad`` assigned 0.25s: the next backward gives it 0.25 plus its
    gradient and the others their gradient. Each as the unsharded model given the same
    treatment (this rank's part of it)."""
    model, oracle = _build(ctx, strategy)
    for m in (model, oracle):  # before any backward: the first one adds to it
        p = _named(ctx, m)["head.bias"] if m is model else m.head.bias
        p.grad = torch.full_like(p, 0.25)
    _step(ctx, model, oracle, 0)
    dropped = ("inner.bias", "head.weight")
    for m in (model, oracle):
        params = _named(ctx, m) if m is model else dict(m.named_parameters())
        for name in dropped:
            params[name].grad = None
        p = params["inner.weight"]
        p.grad = torch.full_like(p, 0.5)
    x, mine = _batch(ctx, 1)
    out = model(mine)
    for name in dropped:
        grad = _named(ctx, model)[name].grad
        assert grad is None, (
            f"{ctx.where()} after the forward following {name}.grad = None: its gradient is "
            f"{tuple(grad.shape)} {grad.reshape(-1)[:4].tolist()}..., expected None"
        )
    _loss(out, 1).backward()
    _loss(oracle(x), ctx.world_size).backward()
    assert_orig_param_grads(ctx, model, oracle, "after .grad = None / a new .grad and a backward")
    for m in (model, oracle):
        m.zero_grad(set_to_none=True)
        p = _named(ctx, m)["head.bias"] if m is model else m.head.bias
        p.grad = torch.full_like(p, 0.25)
    _step(ctx, model, oracle, 2)
    assert_orig_param_grads(
        ctx, model, oracle, "after zero_grad, head.bias.grad = 0.25s, a backward"
    )


@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_API}, world_sizes=(1, 2))
def orig_params_no_sync(ctx):
    """R45: ``use_orig_params=True``: three micro-batches, the first two inside ``model.no_sync()``
    (the nested unit resharded after each forward while holding the accumulated unsharded
    gradient): the gradients after the third (synced) backward are the unsharded model's summed
    over the three, and one SGD step gives its parameters."""
    model, oracle = _build(ctx)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    for micro in range(3):
        with model.no_sync() if micro < 2 else contextlib.nullcontext():
            _step(ctx, model, oracle, micro)
    assert_orig_param_grads(ctx, model, oracle, "after 2 no_sync micro-batches and a synced one")
    for opt in opts:
        opt.step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"after the no_sync step: {name}", got[name], ref, FP32["param"])


# ------------------------------------------------------------------------------ R46
@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"data": {"what": "parameter"}, "grad": {"what": "gradient"}},
    world_sizes=(1, 2),
)
def orig_params_shape_change_refused(ctx, what):
    """R46: replacing an original parameter's ``.data`` (or, after a backward, its gradient's
    ``.grad.data``) by a tensor of another shape (here one element more than it holds on this
    rank) cannot be written back into the flat parameter (or its gradient): the next forward
    raises RuntimeError "Cannot writeback when the parameter shape changes" (or "... the gradient
    shape changes")."""
    model, oracle = _build(ctx)
    _step(ctx, model, oracle, 0)
    p = _named(ctx, model)["inner.weight"]
    target = p if what == "parameter" else p.grad
    assert target is not None and target.numel() > 0, f"{ctx.where()} test setup: {what} empty"
    with torch.no_grad():
        target.data = torch.zeros(target.numel() + 1, device=p.device, dtype=p.dtype)
    _, mine = _batch(ctx, 1)
    want = f"Cannot writeback when the {what} shape changes"
    try:
        model(mine)
    except RuntimeError as exc:
        assert want in str(exc), (
            f"{ctx.where()} forward after a shape-changing {what}: RuntimeError {exc!r} does not "
            f"say {want!r}"
        )
        return
    raise AssertionError(
        f"{ctx.where()} forward after the inner.weight {what} got {target.numel()} elements: "
        f"accepted, expected RuntimeError {want!r}"
    )


# ------------------------------------------------------------------------------ R47
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def orig_params_shard_grad_op(ctx):
    """R47: ``use_orig_params=True`` with SHARD_GRAD_OP on both units (the nested one keeps its
    gathered parameters from forward to backward): two SGD steps give the unsharded model's
    parameters; then, where the unit shards (ws 2), replacing ``inner.weight.data`` between a
    forward and its backward is refused with AssertionError naming "changing the parameters
    between forward and backward"."""
    model, oracle = _build(ctx, "SHARD_GRAD_OP")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    for step in range(2):
        _step(ctx, model, oracle, step)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert_close(ctx, f"after 2 SHARD_GRAD_OP steps: {name}", got[name], ref, FP32["param"])
    if ctx.world_size == 1:
        return  # NO_SHARD at world size 1: nothing is gathered, nothing to refuse
    _, mine = _batch(ctx, 2)
    out = model(mine)
    p = _named(ctx, model)["inner.weight"]
    with torch.no_grad():
        p.data = p.data.clone()
    try:
        _loss(out, 1).backward()
    except AssertionError as exc:
        assert "changing the parameters between forward and backward" in str(exc), (
            f"{ctx.where()} backward after .data replaced since forward: {exc!r} does not "
            "say 'changing the parameters between forward and backward'"
        )
        return
    raise AssertionError(
        f"{ctx.where()} SHARD_GRAD_OP: backward after inner.weight.data was replaced since "
        "its forward was accepted; expected AssertionError 'does not support changing the "
        "parameters between forward and backward'"
    )


# ------------------------------------------------------------------------------ R48
class _Shared(nn.Module):
    """``TwoUnits`` plus ``alias``, a Linear whose weight is ``head.weight`` (same unit)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.alias = nn.Linear(7, 3, bias=False)
        self.alias.weight = self.head.weight

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.head(h) + self.alias(h.flip(-1))


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"full-shard": {"strategy": None}, "no-shard": {"strategy": "NO_SHARD"}},
    world_sizes=(1, 2),
)
def summon_with_grads_edges(ctx, strategy):
    """R48: ``summon_full_params(model, with_grads=True)`` with ``use_orig_params=True``, on a
    root owning a weight registered under two names (``head.weight`` is ``alias.weight``):
    before any backward every parameter has ``.grad`` None inside; after a backward every name,
    the alias included, has the full gradient of the unsharded model (the alias the same values
    as ``head.weight``), also under NO_SHARD; a gradient doubled in place inside is doubled
    after exit (writeback=True)."""
    model, oracle = _build(ctx, strategy, _Shared())
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters(remove_duplicate=False):
            assert p.grad is None, (
                f"{ctx.where()} summon(with_grads) before any backward: {name}.grad is "
                f"{tuple(p.grad.shape)}, expected None"
            )
    _step(ctx, model, oracle, 0)
    refs = dict(oracle.named_parameters(remove_duplicate=False))
    with FSDP.summon_full_params(model, with_grads=True):
        mods = dict(model.named_modules())
        for name, ref in refs.items():
            mod, _, attr = name.rpartition(".")
            holder = next(m for n, m in mods.items() if ctx.impl.clean_fqn(n) == mod)
            grad = getattr(holder, attr).grad
            assert grad is not None, f"{ctx.where()} inside summon(with_grads): {name}.grad None"
            assert_close(
                ctx, f"inside summon(with_grads): {name}.grad", grad, ref.grad, FP32["grad"]
            )
    # writeback=True (the default): an in-place change of a .grad inside persists.
    with FSDP.summon_full_params(model, with_grads=True):
        for p in model.parameters():
            p.grad.mul_(2)
    for ref in oracle.parameters():
        ref.grad.mul_(2)
    assert_orig_param_grads(ctx, model, oracle, "after .grad *= 2 inside summon(with_grads)")
    if strategy is not None or ctx.world_size == 1:
        return
    # The last rank clears every .grad (zero_grad): it contributes zeros for its elements.
    held = {n: (v.offset, v.local.numel()) for n, v in ctx.impl.local_shards(model).items()}
    ranges = [None] * ctx.world_size
    dist.all_gather_object(ranges, held)
    last = ranges[-1]
    if ctx.rank == ctx.world_size - 1:
        model.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model, with_grads=True):
        got = visible(ctx, model)
        for name, ref in oracle.named_parameters():
            want = ref.grad.detach().clone().reshape(-1)
            offset, n = last[name]
            want[offset : offset + n] = 0
            grad = got[name].grad
            assert grad is not None, f"{ctx.where()} summon(with_grads): {name}.grad None"
            assert_close(
                ctx,
                f"summon(with_grads), rank {ctx.world_size - 1}'s gradients cleared: {name}.grad",
                grad.reshape(-1),
                want,
                FP32["grad"],
            )


# ------------------------------------------------------------------------------ R49
@check(area="fsdp1_runtime", requires=REQUIRES | {base.FSDP1_MODULE_TO}, world_sizes=(1, 2))
def orig_params_module_to_dtype(ctx):
    """R49: ``model.to(torch.float64)`` on the wrapped model (``use_orig_params=True``) after
    construction and before the first forward converts every unit's flat parameter and so every
    original parameter (each named parameter float64, same names); a forward, backward and SGD
    step then equal the unsharded model converted alike: float64 output, float64 gradients and
    parameters with the oracle's values. Where the unit shards, ``.to(torch.float64)`` after a
    backward converts each original parameter's gradient too (float64, the unsharded model's
    values)."""
    model, oracle = _build(ctx)
    names = sorted(_named(ctx, model))
    model.to(torch.float64)
    oracle.to(torch.float64)
    after = _named(ctx, model)
    assert sorted(after) == names, f"{ctx.where()} names after .to(): {sorted(after)} vs {names}"
    for name, p in after.items():
        assert p.dtype == torch.float64, f"{ctx.where()} after .to(float64): {name} is {p.dtype}"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    x, mine = _batch(ctx, 0, torch.float64)
    out = model(mine)
    assert out.dtype == torch.float64, f"{ctx.where()} forward output {out.dtype}, expected float64"
    _loss(out, 1).backward()
    _loss(oracle(x), ctx.world_size).backward()
    for name, p in _named(ctx, model).items():
        assert p.grad is None or p.grad.dtype == torch.float64, (
            f"{ctx.where()} {name}.grad is {p.grad.dtype}, expected float64"
        )
    views = ctx.impl.local_shards(model)
    grads = {name: p.grad for name, p in _named(ctx, model).items()}
    for name, ref in oracle.named_parameters():
        view, grad = views[name], grads[name]
        n = view.local.numel()
        want = ref.grad.detach().reshape(-1)[view.offset : view.offset + n]
        if n == 0:
            continue
        assert grad is not None, f"{ctx.where()} after .to(float64): {name} has no gradient"
        assert_close(ctx, f"after .to(float64): {name}.grad", grad.reshape(-1), want, FP64)
    for opt in opts:
        opt.step()
    got = full_params(ctx, model)
    for name, ref in oracle.named_parameters():
        assert got[name].dtype == torch.float64, f"{ctx.where()} {name} is {got[name].dtype}"
        assert_close(ctx, f"after .to(float64) and a step: {name}", got[name], ref, FP64)
    # After a backward, where the unit shards: .to(float64) converts the gradients too, as
    # nn.Module.to does (upstream leaves NO_SHARD's float32 gradient views in place).
    if ctx.world_size == 1:
        return
    model, oracle = _build(ctx)
    _step(ctx, model, oracle, 1)
    model.to(torch.float64)
    oracle.to(torch.float64)
    views = ctx.impl.local_shards(model)
    for name, p in _named(ctx, model).items():
        view, ref = views[name], oracle.get_parameter(name).grad
        if view.local.numel() == 0:
            continue
        assert p.grad is not None and p.grad.dtype == torch.float64, (
            f"{ctx.where()} .to(float64) after a backward: {name}.grad is "
            f"{None if p.grad is None else p.grad.dtype}, expected float64"
        )
        want = ref.reshape(-1)[view.offset : view.offset + view.local.numel()]
        assert_close(
            ctx,
            f".to(float64) after a backward: {name}.grad",
            p.grad.reshape(-1),
            want,
            FP32["grad"],
        )


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.MIXED_PRECISION},
    cases=ORIG,
    world_sizes=(2,),
)
def low_precision_grads_accumulate(ctx, orig):
    """R45: ``MixedPrecision(param_dtype=bf16, keep_low_precision_grads=True)``, FULL_SHARD at
    ws 2: a second backward without zeroing adds to the first (the bf16 gradient the optimizer
    saw is taken back into the accumulation): each original parameter's gradient, reassembled
    from the ranks' flat gradients, is the unsharded model's summed over both batches (bf16:
    rtol 3e-2, atol 3e-3) and in bf16."""
    ctx.seed(0)
    model = TwoUnits().to(ctx.device)
    oracle = copy.deepcopy(model)
    mp = {"param_dtype": torch.bfloat16, "keep_low_precision_grads": True}
    model = ctx.impl.shard(
        model, ctx, plan=[("inner", {}), ("", {})], use_orig_params=orig, mixed_precision=mp
    )
    for step in range(2):
        _step(ctx, model, oracle, step)
    if orig:  # each parameter's gradient through the layout views (the layout holds padding)
        views = ctx.impl.local_shards(model)
        for name, p in _named(ctx, model).items():
            view, ref = views[name], oracle.get_parameter(name).grad
            n = view.local.numel()
            if n == 0:
                continue
            assert p.grad is not None, f"{ctx.where()} {name}: no gradient after two backwards"
            assert p.grad.dtype == torch.bfloat16, f"{ctx.where()} {name}.grad is {p.grad.dtype}"
            want = ref.reshape(-1)[view.offset : view.offset + n]
            got = p.grad.float().reshape(-1)
            assert_close(ctx, f"{name}.grad after two backwards", got, want, BF16_TOL)
        return
    grads_of = getattr(ctx.impl, "flat_grads", None)
    if grads_of is None:
        raise base.NotSupported("flat_grads (the flat parameters' gradients)")
    for fqns, grad in grads_of(model):
        assert grad is not None, f"{ctx.where()} {fqns}: no flat gradient after two backwards"
        assert grad.dtype == torch.bfloat16, f"{ctx.where()} {fqns}: gradient {grad.dtype}"
        flat = torch.cat([oracle.get_parameter(f).grad.reshape(-1) for f in fqns])
        chunk = -(-flat.numel() // ctx.world_size)  # ceil(N / ws), zero padded
        want = torch.zeros(chunk)
        part = flat[ctx.rank * chunk : (ctx.rank + 1) * chunk]
        want[: part.numel()] = part
        got = grad.float().reshape(-1)
        assert_close(ctx, f"{fqns}: flat gradient after two backwards", got, want, BF16_TOL)


class _Transposed(nn.Module):
    """``TwoUnits`` whose ``head.weight`` is a transposed (non-contiguous) Parameter."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.head.weight = nn.Parameter(torch.randn(7, 3).t())

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


@check(area="fsdp1_runtime", requires=REQUIRES, cases=ORIG, world_sizes=(1, 2))
def non_contiguous_param(ctx, orig):
    """R46: a parameter that is not contiguous when the unit is built (``head.weight`` a
    transposed (7, 3) tensor) keeps its logical values: inside ``summon_full_params`` it equals
    the unsharded model's, the forward does too, and after one SGD step both again."""
    ctx.seed(0)
    model = _Transposed().to(ctx.device)
    assert not model.head.weight.is_contiguous(), f"{ctx.where()} test setup: contiguous"
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, plan=[("inner", {}), ("", {})], use_orig_params=orig)
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, oracle)]
    for step in range(2):
        x, mine = _batch(ctx, step)
        out = model(mine)
        assert_close(ctx, f"step {step} forward", out, oracle(mine).detach(), FP32["param"])
        _loss(out, 1).backward()
        _loss(oracle(x), ctx.world_size).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with FSDP.summon_full_params(model):
            got = visible(ctx, model)
            for name, ref in oracle.named_parameters():
                assert_close(ctx, f"after step {step}: {name}", got[name], ref, FP32["param"])


# ------------------------------------------------------------------------------ R59
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def orig_params_optimizer_in_backward(ctx):
    """R59: ``torch.distributed.optim._apply_optimizer_in_backward(SGD, lr 0.1, momentum 0.9)``
    on the wrapped model's original parameters (``use_orig_params=True``): over 3 iterations of
    forward and backward only (no optimizer step by the user), the parameters after each backward
    equal the unsharded model's after its backward and an SGD step with the same settings."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    model, oracle = _build(ctx)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), kwargs)
    oopt = torch.optim.SGD(oracle.parameters(), **kwargs)
    for step in range(3):
        _step(ctx, model, oracle, step)
        oopt.step()
        oopt.zero_grad(set_to_none=True)
        got = full_params(ctx, model)
        for name, ref in oracle.named_parameters():
            assert_close(ctx, f"iteration {step} {name}", got[name], ref, FP32["param"])
