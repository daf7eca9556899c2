"""The training oracle: the same model trained in one process on the global batch, next to the
sharded one. The training checks of FSDP2 (``fully_shard/training.py``) and FSDP1
(``fsdp1/training.py``) compare against it, and other parts borrow its tolerances and helpers.

[Note: the oracle]
Every rank builds the model from the same seed and keeps an unsharded copy (the *oracle*). Each step
draws one global batch of ``ws * B`` samples (identical on every rank); rank r feeds samples
``r*B .. (r+1)*B`` to the sharded model, while the oracle sees the whole batch locally, with no
communication. The losses are means, so the oracle's gradient is the mean of the ranks' local
gradients, which is exactly what FSDP's reduce-scatter (average over ranks) must produce:
* rank r's loss == the oracle's loss on the samples of rank r (before each step);
* rank r's sharded gradient == its chunk of the oracle's gradient (chunk = ``ceil(d/ws)`` rows on
  the shard dim, possibly none) (P6);
* after the optimizer steps, every parameter's ``full_tensor()`` == the oracle's parameter.
Tolerances (fp32): ``rtol=1e-5, atol=1e-6`` on losses and gradients, ``rtol=1e-4, atol=1e-5`` on
parameters (summation order differs). bf16 compute is compared with the fp32 oracle through each
step's parameter update: ``|update - oracle update| <= 0.05 * |oracle update|`` (norms), and losses
within ``rtol=2e-2``; a missing or doubled gradient average is a 100% error, far outside either.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from conformance.checks._shared.rows import chunk_of as local_chunk

B = 2  # samples per rank per step
STEPS = 3
FP32 = {
    "loss": dict(rtol=1e-5, atol=1e-6),
    "grad": dict(rtol=1e-5, atol=1e-6),
    "param": dict(rtol=1e-4, atol=1e-5),
}


class MLP(nn.Module):
    """Linear(5, 7) -> tanh -> Linear(7, 3): dims 7 and 3 are uneven for ws 2 and 4 and 3 < ws 4."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class Tiny(nn.Module):
    """Every dim below the world size at ws 3/4: Linear(5, 2) -> tanh -> Linear(2, 1)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 2)
        self.out = nn.Linear(2, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class TiedLM(nn.Module):
    """Embedding(11, 6) whose weight is also the output projection's weight (tied)."""

    vocab = 11

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, self.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


class WithEmpty(Tiny):
    """``Tiny`` plus a zero-numel (0,) parameter ``empty`` that forward uses (``+ empty.sum()``),
    so its gradient is an empty tensor of shape (0,) in the oracle and in every rank's unit."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return super().forward(x) + self.empty.sum()


class Wide(nn.Module):
    """Linear(5, 4) -> tanh -> Linear(4, rows), summed to one output: dim 1 of ``out.weight`` (4)
    divides ws 1, 2 and 4, so it can take ``Shard(1)``."""

    def __init__(self, rows: int):
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.out = nn.Linear(4, rows)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x))).sum(dim=1, keepdim=True)


MODELS = {
    "mlp": MLP,
    "tiny": Tiny,
    "tied": TiedLM,
    "empty": WithEmpty,
    "wide4": lambda: Wide(4),
    "wide1": lambda: Wide(1),
}
PLANS = {
    "root": None,
    "nested": [("inp", {}), ("out", {}), ("", {})],  # children first, root last
}


def make_batch(model_name: str, ws: int, step: int, device):
    """One global batch of ws*B samples, identical on every rank: (inputs, targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = ws * B
    if model_name == "tied":
        x = torch.randint(0, TiedLM.vocab, (n, 4), generator=g)
        y = torch.randint(0, TiedLM.vocab, (n, 4), generator=g)
    else:
        x = torch.randn(n, 5, generator=g)
        y = torch.randn(n, 3 if model_name == "mlp" else 1, generator=g)
    return x.to(device), y.to(device)


def per_sample_loss(model_name: str, out, y):
    """Loss per sample (mean over the sample's elements)."""
    if model_name == "tied":
        return (
            F.cross_entropy(out.flatten(0, 1).float(), y.flatten(), reduction="none")
            .view(y.shape)
            .mean(dim=1)
        )
    return ((out.float() - y) ** 2).mean(dim=1)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def shard_dim(param) -> int:
    from torch.distributed.tensor import Shard

    (placement,) = [p for p in param.placements if isinstance(p, Shard)]
    return placement.dim


def named_unique(model, impl=None):
    """(name, parameter) once per parameter (named_parameters dedups ties); with ``impl``, the
    names are its clean FQNs (the sharded model's wrappers may rename them)."""
    clean = impl.clean_fqn if impl is not None else str
    return [(clean(n), p) for n, p in model.named_parameters()]


def assert_close(ctx, what, actual, expected, tol):
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert actual.shape == expected.shape, (
        f"{ctx.where()} {what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if not torch.allclose(actual, expected, **tol):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{ctx.where()} {what}: max abs difference {diff:.3g} exceeds {tol}")


def run_parity(
    ctx,
    model_name="mlp",
    plan="root",
    optim="sgd",
    steps=STEPS,
    options=None,
    accumulate=1,
    mp_tolerance=False,
    after_shard=None,
    shards=None,
):
    """Train the sharded model and the oracle side by side and compare (see the module Note).

    ``accumulate``: micro-batches per optimizer step; all but the last run with gradient sync off
    (``set_requires_gradient_sync(False)``). ``mp_tolerance``: compare updates, not values.
    ``shards``: (shard-group size, this rank's index in it) when the mesh is 2-D (HSDP); default
    (ws, rank)."""
    from torch.distributed.tensor import DTensor

    ctx.seed(0)
    model = MODELS[model_name]().to(ctx.device)
    oracle = copy.deepcopy(model)
    model = ctx.impl.shard(model, ctx, plan=PLANS[plan], **(options or {}))
    if after_shard is not None:
        after_shard(model)
    opt = make_optimizer(optim, model.parameters())
    oopt = make_optimizer(optim, oracle.parameters())
    ws, rank = ctx.world_size, ctx.rank
    parts, index = shards or (ws, rank)
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(steps):
        if mp_tolerance:
            before = {
                n: p.detach().full_tensor().cpu().float().clone()  # never alias the param
                for n, p in named_unique(model, ctx.impl)
            }
            obefore = {n: p.detach().clone().cpu() for n, p in named_unique(oracle)}
        for micro in range(accumulate):
            x, y = make_batch(model_name, ws, step * accumulate + micro, ctx.device)
            last = micro == accumulate - 1
            if accumulate > 1:
                model.set_requires_gradient_sync(last)
            loss = per_sample_loss(model_name, model(x[mine]), y[mine]).mean()
            oloss_all = per_sample_loss(model_name, oracle(x), y)
            (oloss_all.mean()).backward()  # mean over ws*B == mean of the ranks' local means
            loss.backward()
            tol = dict(rtol=2e-2, atol=1e-3) if mp_tolerance else FP32["loss"]
            assert_close(
                ctx, f"step {step} micro-batch {micro} loss", loss, oloss_all[mine].mean(), tol
            )
        if not mp_tolerance:
            for name, param in named_unique(model, ctx.impl):
                if oracle.get_parameter(name).grad is None:
                    continue
                grad = param.grad
                assert isinstance(grad, DTensor), (
                    f"{ctx.where()} {name}: sharded grad is {type(grad).__name__}, expected a DTensor"
                )
                expected = local_chunk(
                    oracle.get_parameter(name).grad, shard_dim(param), parts, index
                )
                assert_close(
                    ctx,
                    f"step {step} {name} sharded grad (vs the oracle's mean-gradient chunk)",
                    grad.to_local(),
                    expected,
                    FP32["grad"],
                )
        opt.step()
        oopt.step()
        opt.zero_grad()
        oopt.zero_grad()
        if mp_tolerance:
            for name, param in named_unique(model, ctx.impl):
                update = param.detach().full_tensor().cpu().float() - before[name]  # noqa: F821
                oupdate = oracle.get_parameter(name).detach().cpu() - obefore[name]  # noqa: F821
                err = (update - oupdate).norm().item()
                scale = oupdate.norm().item()
                assert err <= 0.05 * scale + 1e-6, (
                    f"{ctx.where()} {name} step {step}: update differs from the fp32 oracle's by "
                    f"{err:.3g} (norm), more than 5% of its norm {scale:.3g}"
                )
    for name, param in named_unique(model, ctx.impl):
        full = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
        tol = dict(rtol=2e-2, atol=2e-3) if mp_tolerance else FP32["param"]
        assert_close(ctx, f"{name} after {steps} steps", full, oracle.get_parameter(name), tol)
    return model


def assert_sharded_grad(ctx, what: str, param, full_grad) -> None:
    """``param``'s local gradient is this rank's chunk of the oracle's ``full_grad`` (on the
    parameter's shard dim; fp32 tolerance)."""
    expected = local_chunk(full_grad, shard_dim(param), ctx.world_size, ctx.rank)
    assert_close(ctx, what, param.grad.to_local(), expected, FP32["grad"])


def own_grads(model_name: str, oracle, x, y, ws: int, reduce: str) -> list[dict]:
    """Each rank's gradient of its own ``B`` samples of the global batch ``(x, y)`` on a copy of
    the unsharded ``oracle`` (per-sample losses ``reduce``d: "sum" or "mean"), by parameter name."""
    grads = []
    for r in range(ws):
        copy_r = copy.deepcopy(oracle)
        rows = slice(r * B, (r + 1) * B)
        getattr(per_sample_loss(model_name, copy_r(x[rows]), y[rows]), reduce)().backward()
        grads.append({n: p.grad for n, p in copy_r.named_parameters()})
    return grads


def assert_summed_then_divided(ctx, name: str, param, own: list[dict], f: float) -> None:
    """Force-sum at world size 2: ``param``'s local gradient equals this rank's chunk of
    ``(g0 + g1) / f`` bit for bit (``own``: each rank's gradient, :func:`own_grads`); two addends
    have one order, and with an ``f`` that is no power of two dividing before the sum differs in
    the last bit of some elements."""
    full = (own[0][name] + own[1][name]) / f
    expected = local_chunk(full, shard_dim(param), ctx.world_size, ctx.rank)
    got = param.grad.to_local()
    if not torch.equal(got, expected):
        diff = (got - expected).abs().max().item()
        raise AssertionError(
            f"{ctx.where()} {name}: the sharded gradient with force-sum and divide factor {f:g} "
            f"is not bit-equal to (g0 + g1) / {f:g}, the sum divided after it (max abs "
            f"difference {diff:.3g}: divided before summing, or not by {f:g}?)"
        )


def step_and_compare(ctx, model, oracle, optimizers, step: int) -> None:
    """Step and zero every optimizer in ``optimizers`` (the sharded model's and the oracle's),
    then every sharded parameter's full value equals the oracle's (fp32 tolerance)."""
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{fqn} after step {step}",
            param.detach().full_tensor(),
            oracle.get_parameter(fqn),
            FP32["param"],
        )


def backward_and_compare(ctx, model, oracle, outputs, optimizers, step: int) -> None:
    """One fully_shard training step against the oracle: ``outputs`` is ``(out, oout, y, mine)``
    (this rank's output, the oracle's on the global batch, the targets, this rank's slice of the
    batch); the losses (mean squared error) agree, every sharded parameter's gradient is a DTensor
    holding this rank's chunk of the oracle's (``.grad`` None where the oracle has none: its
    module never ran), then :func:`step_and_compare`."""
    from torch.distributed.tensor import DTensor

    out, oout, y, mine = outputs
    loss = ((out - y[mine]) ** 2).mean()
    oloss = ((oout - y) ** 2).mean(dim=1)
    assert_close(ctx, f"step {step} loss", loss, oloss[mine].mean(), FP32["loss"])
    loss.backward()
    oloss.mean().backward()
    for fqn, param in model.named_parameters():
        ograd = oracle.get_parameter(fqn).grad
        if ograd is None:
            assert param.grad is None, (
                f"{ctx.where()} step {step} {fqn}: has a gradient, but its module never ran"
            )
            continue
        assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), (
            f"{ctx.where()} step {step} {fqn}: after backward expected a SHARDED parameter "
            f"with a DTensor gradient, got {type(param).__name__} / "
            f"{type(param.grad).__name__}"
        )
        assert_sharded_grad(ctx, f"step {step} {fqn} sharded grad", param, ograd)
    step_and_compare(ctx, model, oracle, optimizers, step)
