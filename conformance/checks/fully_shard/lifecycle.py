"""Area "lifecycle": a ``fully_shard`` module across its life, from construction to reloading
(P9, P10, P12, P17), and a container without ``forward`` refused (P98).

[Note: what each check compares]
* Tied parameters: a parameter may belong to one FSDP group only. Tying it across two separate
  ``fully_shard`` calls is refused with ``ValueError`` ("... is shared with a parameter already
  managed by another FSDP group ...") by the first forward at the latest (upstream raises at lazy
  init); tying it inside one group (``fully_shard([a, b])``) trains like the unsharded model.
* Meta-device init: parameters created on ``meta``, sharded there, then materialised with
  ``to_empty(device)`` and each module's ``reset_parameters()``. The layout afterwards follows the
  rows rule (``_rows``), and forward/backward/step match an oracle built directly with the values
  ``reset_parameters`` wrote, which only happens if FSDP re-derived its all-gather source from the
  new storage.
* Lazy init: the first forward must go through the single root; the errors and their messages
  are upstream's (``RuntimeError``).
* ``module.to(dtype)`` and ``load_state_dict(assign=True)`` replace the sharded tensors; FSDP must
  re-pad them (``reset_sharded_param``) so that the next all-gather sees the new values: forward,
  gradients and a step are compared with the oracle given the same conversion or load.
Expected values come from the single-process oracle and the rows rule, never from the
implementation under test.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values, expect_error
from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.bad_input import _assert_untouched, _snapshot
from conformance.registry import check

TOL = dict(rtol=1e-5, atol=1e-6)


class Chain(nn.Module):
    """inp Linear(5, 7) -> a Linear(7, 7) -> b Linear(7, 7) -> out Linear(7, 3), tanh between;
    ``tie``: b.weight is a.weight. Dims 7 and 3 are uneven at ws 2-4, 3 < ws at ws 4."""

    def __init__(self, tie: bool = False):
        super().__init__()
        self.inp, self.a, self.b, self.out = (
            nn.Linear(5, 7),
            nn.Linear(7, 7),
            nn.Linear(7, 7),
            nn.Linear(7, 3),
        )
        if tie:
            self.b.weight = self.a.weight
        self.reset_parameters()

    def reset_parameters(self):
        """Deterministic values (no RNG), written in place so that DTensor parameters get them too."""
        with torch.no_grad():
            for salt, (_, param) in enumerate(self.named_parameters()):
                full = distinct_values(tuple(param.shape), salt).to(param.device) / 100.0
                if _is_dtensor(param):
                    from torch.distributed.tensor import distribute_tensor

                    full = distribute_tensor(full, param.device_mesh, param.placements)
                param.copy_(full)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.out(h)


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def batch(ctx, step: int):
    """One global batch of 2 samples per rank (identical on every rank) and this rank's slice."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * ctx.world_size, 5, generator=g).to(ctx.device)
    y = torch.randn(2 * ctx.world_size, 3, generator=g).to(ctx.device)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    return x, y, mine


def assert_close(ctx, what, got, expected, tol=TOL):
    got, expected = got.detach().cpu(), expected.detach().cpu()
    assert got.shape == expected.shape, (
        f"{ctx.where()} {what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    if not torch.allclose(got.to(expected.dtype), expected, **tol):
        diff = (got.to(expected.dtype) - expected).abs().max().item()
        raise AssertionError(
            f"{ctx.where()} {what}: max abs difference {diff:.3g} from the oracle exceeds {tol}"
        )


def assert_layout(ctx, model, full: dict[str, torch.Tensor], what: str):
    """Every registered parameter is a DTensor whose local piece is chunk ``rank`` of ``full``."""
    for fqn, param in model.named_parameters():
        assert _is_dtensor(param), f"{ctx.where()} {fqn} {what}: registered {type(param).__name__}"
        expected = chunk_of(full[fqn], 0, ctx.world_size, ctx.rank)
        assert_close(
            ctx,
            f"{fqn} local shard {what} (rows of chunk {ctx.rank})",
            param.to_local(),
            expected,
            dict(rtol=0, atol=0),
        )


def assert_padded(ctx, model, full: dict[str, torch.Tensor], what: str):
    """Where the implementation exposes its padded storage: it has ``full``'s dtype and starts with
    the rank's rows of ``full``."""
    for fqn, view in ctx.impl.local_shards(model).items():
        if view.padded is None:
            continue
        rows = chunk_of(full[fqn], 0, ctx.world_size, ctx.rank).reshape(-1)
        assert view.padded.dtype == full[fqn].dtype, (
            f"{ctx.where()} {fqn} {what}: padded storage dtype {view.padded.dtype}, expected "
            f"{full[fqn].dtype}"
        )
        assert_close(
            ctx,
            f"{fqn} padded storage {what}",
            view.padded[: rows.numel()],
            rows,
            dict(rtol=0, atol=0),
        )


def train_and_compare(ctx, model, oracle, steps: int, what: str, dtype=torch.float32):
    """``steps`` SGD steps of both; compare losses, sharded gradients and final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for step in range(steps):
        x, y, mine = batch(ctx, step)
        x, y = x.to(dtype), y.to(dtype)
        loss = F.mse_loss(model(x[mine]), y[mine])
        oloss_all = ((oracle(x) - y) ** 2).mean(dim=1)
        assert_close(ctx, f"{what}: step {step} loss", loss, oloss_all[mine].mean())
        loss.backward()
        oloss_all.mean().backward()
        for fqn, param in model.named_parameters():
            expected = chunk_of(oracle.get_parameter(fqn).grad, 0, ctx.world_size, ctx.rank)
            assert param.grad is not None, f"{ctx.where()} {what}: {fqn} has no gradient"
            assert_close(
                ctx, f"{what}: step {step} sharded grad of {fqn}", param.grad.to_local(), expected
            )
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    for fqn, param in model.named_parameters():
        assert_close(
            ctx,
            f"{what}: {fqn} after {steps} steps",
            param.full_tensor(),
            oracle.get_parameter(fqn),
            dict(rtol=1e-4, atol=1e-5),
        )


# ---------------------------------------------------------------------------------- tied parameters
TIED_ACROSS = {  # units sharded, children first; b.weight is a.weight
    "a-and-b": ["a", "b", ""],  # the tie spans two sibling groups
    "a-and-root": ["a", ""],  # b (and its tied weight) falls to the root group
}
SHARED_MSG = (
    r"Parameter '(a|b)\.weight' is shared with a parameter already managed by another FSDP group"
)


@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS},
    cases={k: {"units": v} for k, v in TIED_ACROSS.items()},
)
def tied_across_groups_refused(ctx, units):
    """A parameter tied across two separate ``fully_shard`` groups is refused with ValueError
    "Parameter '<fqn>' is shared with a parameter already managed by another FSDP group ..." (naming
    one of the two FQNs) by ``fully_shard`` or the first forward, on every rank (P17)."""
    model = Chain(tie=True).to(ctx.device)

    def shard():
        for unit in units:
            ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)

    x, _, mine = batch(ctx, 0)
    expect_error(
        ctx,
        f"b.weight tied to a.weight, units {units}",
        ValueError,
        SHARED_MSG,
        shard,
        lambda: model(x[mine]),
    )


@check(area="lifecycle", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def tied_within_one_group(ctx):
    """A parameter tied between two modules sharded together (``fully_shard([a, b])``) is managed
    once: it is sharded like any parameter and 3 SGD steps match the oracle's losses, gradients and
    parameters (the tied gradient is the sum over both uses) (P17)."""
    model = Chain(tie=True).to(ctx.device)
    oracle = copy.deepcopy(model)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ns = ctx.impl.ns
    ns.fully_shard([model.a, model.b], mesh=ctx.mesh)
    ns.fully_shard(model, mesh=ctx.mesh)
    assert model.b.weight is model.a.weight, (
        f"{ctx.where()} after fully_shard([a, b]) b.weight is no longer a.weight (tie broken)"
    )
    assert_layout(ctx, model, full, "after fully_shard([a, b])")
    train_and_compare(ctx, model, oracle, 3, "tied within one group")
    assert model.b.weight is model.a.weight, (
        f"{ctx.where()} after training b.weight is not a.weight"
    )


# ---------------------------------------------------------------------------------- meta-device init
@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    cases={"nested": {"units": ["inp", "a", "b", "out", ""]}, "root": {"units": [""]}},
)
def meta_init_materialized(ctx, units):
    """A model built and sharded on the meta device, then ``to_empty(device)`` and
    the model's ``reset_parameters()``: every parameter is a DTensor on the device whose local shard holds the
    rank's rows of the values reset wrote, and 2 SGD steps match an oracle built with those values
    (P10, P9)."""
    with torch.device("meta"):
        model = Chain()
    for unit in units:
        ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)
    for fqn, param in model.named_parameters():
        assert param.is_meta, f"{ctx.where()} {fqn}: on {param.device} after fully_shard on meta"
    model.to_empty(device=ctx.device)
    model.reset_parameters()
    oracle = Chain().to(ctx.device)
    full = {n: p.detach().clone() for n, p in oracle.named_parameters()}
    for fqn, param in model.named_parameters():
        assert param.device.type == ctx.device.type, (
            f"{ctx.where()} {fqn}: on {param.device} after to_empty(device={ctx.device})"
        )
    assert_layout(ctx, model, full, "after to_empty + reset_parameters")
    train_and_compare(ctx, model, oracle, 2, "meta init")


# ---------------------------------------------------------------------------------- lazy init errors
def _child_forward_first(ctx):
    model = Chain().to(ctx.device)
    for unit in ("a", ""):
        ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)
    x = torch.ones(2, 7, device=ctx.device)
    return [lambda: model.a(x), lambda: model(torch.ones(2, 5, device=ctx.device))]


def _two_module_root(ctx):
    model = Chain().to(ctx.device)
    ctx.impl.ns.fully_shard([model.inp, model.a], mesh=ctx.mesh)
    return [lambda: model.a(model.inp(torch.ones(2, 5, device=ctx.device)))]


def _meta_forward(ctx):
    with torch.device("meta"):
        model = Chain()
    for unit in ("a", ""):
        ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)
    return [lambda: model(torch.ones(2, 5, device=ctx.device))]


LAZY_INIT_ERRORS = {
    "child-forward-first": (
        _child_forward_first,
        r"already been lazily initialized for a\b[\s\S]*root module first",
    ),
    "two-module-root": (_two_module_root, r"requires a single root module"),
    "meta-not-materialized": (
        _meta_forward,
        r"materialized from meta device[\s\S]*\['inp\.weight', 'inp\.bias'",
    ),
}


@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS},
    cases={k: {"name": k} for k in LAZY_INIT_ERRORS},
)
def lazy_init_errors(ctx, name):
    """The first forward fails with upstream's RuntimeError when it cannot lazily initialise: a child
    ran forward before the root ('FSDP state has already been lazily initialized for a ... FSDP
    requires running forward through the root module first'); the root is a ``fully_shard([m0, m1])``
    group ('FSDP requires a single root module'); parameters still on meta ('FSDP parameters should
    be materialized from meta device before training', naming them) (P12, P10, P17)."""
    build, pattern = LAZY_INIT_ERRORS[name]
    expect_error(ctx, name, RuntimeError, pattern, *build(ctx))


# ---------------------------------------------------------------------------------- replaced tensors
CONVERSIONS = {
    "to-float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "to-bfloat16": lambda m: m.to(torch.bfloat16),
}


@check(
    area="lifecycle",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING},
    cases={k: {"name": k} for k in CONVERSIONS},
)
def reset_after_dtype_conversion(ctx, name):
    """After ``module.to(dtype)`` / ``module.double()`` (``nn.Module._apply``) on a sharded model, the
    sharded parameters are DTensors of that dtype holding the rank's rows of the converted values, so
    is the padded storage the all-gather reads (before any forward, whose lazy init would re-pad
    anyway), and forward, sharded gradients and 2 SGD steps match the oracle converted the same way
    (P9)."""
    convert = CONVERSIONS[name]
    model = Chain().to(ctx.device)
    oracle = convert(copy.deepcopy(model))
    for unit in ("a", "b", ""):
        ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)
    convert(model)
    full = {n: p.detach().clone() for n, p in oracle.named_parameters()}
    dtype = full["a.weight"].dtype
    for fqn, param in model.named_parameters():
        assert param.dtype == dtype and param.to_local().dtype == dtype, (
            f"{ctx.where()} {fqn}: dtype {param.dtype} (local {param.to_local().dtype}) after "
            f"{name}, expected {dtype}"
        )
    assert_layout(ctx, model, full, f"after {name}")
    assert_padded(ctx, model, full, f"after {name}")
    if dtype == torch.bfloat16:  # compare the forward only: bf16 steps drift from any oracle
        x, _, mine = batch(ctx, 0)
        with torch.no_grad():
            assert_close(
                ctx,
                f"{name}: forward output",
                model(x[mine].to(dtype)),
                oracle(x[mine].to(dtype)),
                dict(rtol=1e-2, atol=1e-2),
            )
        return
    train_and_compare(ctx, model, oracle, 2, name, dtype=dtype)


@check(area="lifecycle", requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.TRAINING})
def assign_load_after_forward(ctx):
    """``load_state_dict(sd, assign=True)`` after a first forward/backward installs the loaded
    DTensors as the parameters (new objects, the rank's rows of the loaded values), and the next
    forward, sharded gradients and 2 SGD steps match an oracle given the same values (P9, P8)."""
    model = Chain().to(ctx.device)
    oracle = copy.deepcopy(model)
    for unit in ("a", "b", ""):
        ctx.impl.ns.fully_shard(model.get_submodule(unit), mesh=ctx.mesh)
    x, y, mine = batch(ctx, 7)
    F.mse_loss(model(x[mine]), y[mine]).backward()  # lazy init, all-gather buffers allocated
    model.zero_grad()
    before = dict(model.named_parameters())
    with torch.no_grad():  # new values, in new tensors whose local pieces are not padded
        sd = {k: v.detach() * 2 + 1 for k, v in model.state_dict().items()}
        for p in oracle.parameters():
            p.mul_(2).add_(1)
    model.load_state_dict(sd, assign=True)
    full = {n: p.detach().clone() for n, p in oracle.named_parameters()}
    for fqn, param in model.named_parameters():
        assert param is not before[fqn], (
            f"{ctx.where()} {fqn}: still the old Parameter object after load_state_dict(assign=True)"
        )
    assert_layout(ctx, model, full, "after load_state_dict(assign=True)")
    train_and_compare(ctx, model, oracle, 2, "after an assign-load")


class Stack(nn.ModuleList):
    """A ``ModuleList`` that implements ``forward`` (its layers in turn)."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


@check(area="lifecycle", requires={base.FSDP2_API}, world_sizes=(1,))
def container_without_forward_refused(ctx):
    """P98: ``fully_shard`` of an ``nn.ModuleList`` or ``nn.ModuleDict`` (containers that do not
    implement ``forward``) raises ValueError "fully_shard does not support containers that do not
    implement forward" and shards nothing (no ``FSDPModule``, parameters unchanged); a
    ``ModuleList`` subclass that implements ``forward`` is sharded."""
    ns = ctx.impl.ns
    mesh = ctx.make_mesh((ctx.world_size,))
    ctx.seed(0)
    containers = {
        "nn.ModuleList": nn.ModuleList([nn.Linear(4, 4)]),
        "nn.ModuleDict": nn.ModuleDict({"lin": nn.Linear(4, 4)}),
    }
    for what, container in containers.items():
        before = _snapshot(container)
        expect_error(
            ctx,
            f"fully_shard({what})",
            ValueError,
            r"fully_shard does not support containers that do not implement forward",
            lambda container=container: ns.fully_shard(container.to(ctx.device), mesh=mesh),
        )
        _assert_untouched(ctx, ns, container, before, what)
    stack = Stack([nn.Linear(4, 4)]).to(ctx.device)
    ns.fully_shard(stack, mesh=mesh)
    assert isinstance(stack, ns.FSDPModule), (
        f"{ctx.where()} a ModuleList subclass with forward was not sharded"
    )
