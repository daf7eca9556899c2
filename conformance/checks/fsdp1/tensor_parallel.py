"""Area "fsdp1_runtime": FSDP1 over tensor-parallel DTensor parameters (R69, R70), at world size 4
as a 2 x 2 (dp, tp) mesh; saving and training also at world size 2 on a (2, 1) mesh, where the
parameters are DTensors of a one-rank tp mesh (FSDP1's DTensor paths without a TP split).

[Note: the FSDP1 + TP setup]
Every rank builds ``TPNet`` from seed 0 and keeps an unsharded copy (the oracle). Then
``parallelize_module`` on the tp sub-mesh makes ``in_proj`` ``ColwiseParallel`` (weight and bias
``Shard(0)``) and ``out_proj`` ``RowwiseParallel`` (weight ``Shard(1)``, bias ``Replicate()``;
its output a plain tensor, the same on every tp rank); ``head`` stays a plain Linear, so one flat
parameter holds DTensor and plain parameters. FSDP1 then wraps the whole model as one unit with
``device_mesh=`` the dp sub-mesh (FSDP1 takes its DTensor extensions from a mesh sliced out of a
larger one) and ``use_orig_params=True``: it flattens each parameter's TP-local tensor and shards
that flat parameter over dp.

[Note: the oracle]
Ranks of one tp group see the same samples (those of their dp index); the oracle runs the whole
batch in one process, so FSDP's average over dp must give its gradient, and the FSDP1 model's
parameters, state dicts and optimizer state must be the oracle's. A state dict value may be a
DTensor (upstream: on the tp mesh under FULL, on the (dp, tp) mesh under SHARDED) or, under FULL,
a plain tensor: either way its shape is the parameter's global one (not the TP shard's) and its
full tensor (``full_tensor()``) the oracle's. The FULL dicts are taken with
``offload_to_cpu=False`` (see the CPU-offload aliasing Note of ``state_dict/optim_groups.py``).

[Note: loading an optimizer state dict]
torch 2.13's ``optim_state_dict_to_load`` (``use_orig_params=True``) gathers each DTensor state
over every mesh dim, to the parameter's global tensor, and then slices it at the offsets of the
TP-local parameter in the flat parameter: a rank gets another TP rank's moments (or, for a
``Shard(1)`` weight, its first flat elements), FULL and SHARDED alike, so the step after loading
is not the oracle's. ``tensor_parallel_optim_state_dict_load`` is an expected failure of
torch-fsdp1; saving (``tensor_parallel_optim_state_dict``) is right.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.optim_state import STATE_TOL
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.registry import check

REQUIRES = {base.FSDP1_TENSOR_PARALLEL, base.FSDP1_API, base.TRAINING}
B_TP = 2  # the tp degree at world size 4; at world size 2 the mesh is (2, 1) (see the Note)
B = 2  # samples per dp rank per step
DIM, HIDDEN = 6, 10
STEPS = 2
LR = 1e-2


class TPNet(nn.Module):
    """``in_proj`` Linear(6, 10) (colwise) -> relu -> ``out_proj`` Linear(10, 6) (rowwise) ->
    ``head`` Linear(6, 6) (plain parameters)."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(DIM, HIDDEN)
        self.out_proj = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.out_proj(F.relu(self.in_proj(x))))


def _dims(ctx) -> tuple[int, int]:
    """(dp, tp) sizes of the mesh: (2, 2) at world size 4, (2, 1) at world size 2."""
    tp = B_TP if ctx.world_size >= 2 * B_TP else 1
    return ctx.world_size // tp, tp


def _mine(ctx) -> slice:
    """This rank's samples of a step's batch: those of its dp index."""
    dp_index = ctx.rank // _dims(ctx)[1]
    return slice(dp_index * B, (dp_index + 1) * B)


def _build(ctx, seed=0):
    """(FSDP1 + TP model, plain oracle with the same initial values)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = ctx.make_mesh(_dims(ctx), ("dp", "tp"))
    ctx.seed(seed)
    net = TPNet().to(ctx.device)
    oracle = copy.deepcopy(net)
    parallelize_module(
        net, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ctx.impl.ns.FullyShardedDataParallel(
            net, device_mesh=mesh["dp"], use_orig_params=True, device_id=ctx.device
        )
    return model, oracle


def _step(ctx, net, opt, step, whole=False, oracle=None):
    """One Adam step of ``net`` on the step's batch: this rank's dp samples, or with ``whole``
    (the oracle) all of them; with ``oracle`` given (not yet stepped), the rank's loss must be
    the oracle's on the same samples."""
    g = torch.Generator().manual_seed(900 + step)
    dp = _dims(ctx)[0]
    x = torch.randn(dp * B, DIM, generator=g).to(ctx.device)
    y = torch.randn(dp * B, DIM, generator=g).to(ctx.device)
    if not whole:
        x, y = x[_mine(ctx)], y[_mine(ctx)]
    loss = F.mse_loss(net(x), y)
    if oracle is not None:
        with torch.no_grad():
            want = F.mse_loss(oracle(x), y)
        assert_close(ctx, f"step {step} loss", loss, want, FP32["loss"])
    loss.backward()
    opt.step()
    opt.zero_grad()


def _trained(ctx):
    """(model, its Adam, oracle, its Adam) after STEPS steps, losses compared on the way."""
    model, oracle = _build(ctx)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    oopt = torch.optim.Adam(oracle.parameters(), lr=LR)
    for step in range(STEPS):
        _step(ctx, model, opt, step, oracle=oracle)
        _step(ctx, oracle, oopt, step, whole=True)
    return model, opt, oracle, oopt


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@contextlib.contextmanager
def _context(ctx, model, kind):
    """``state_dict_type(model, ...)`` of ``kind``, FSDP1's warnings silenced inside."""
    ns = ctx.impl.ns
    if kind == "full":
        cfgs = (
            ns.StateDictType.FULL_STATE_DICT,
            ns.FullStateDictConfig(rank0_only=False),
            ns.FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=False),
        )
    else:
        cfgs = (
            ns.StateDictType.SHARDED_STATE_DICT,
            ns.ShardedStateDictConfig(),
            ns.ShardedOptimStateDictConfig(),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation and offload warnings
        with ns.FullyShardedDataParallel.state_dict_type(model, *cfgs):
            yield


def _state_dict(ctx, model, kind):
    with _context(ctx, model, kind):
        return model.state_dict()


def _assert_2d_dtensor(ctx, what, value):
    from torch.distributed.tensor import DTensor

    assert isinstance(value, DTensor) and value.device_mesh.ndim == 2, (
        f"{ctx.where()} {what}: {type(value).__name__} on {getattr(value, 'device_mesh', None)}, "
        "expected a DTensor on the (dp, tp) mesh"
    )


def _assert_values(ctx, what, state_dict, oracle, sharded):
    """``state_dict`` holds the oracle's parameters under its FQNs, each of the global shape; a
    SHARDED dict's values are DTensors on the (dp, tp) mesh."""
    want = {n: p.detach() for n, p in oracle.named_parameters()}
    assert sorted(state_dict) == sorted(want), (
        f"{ctx.where()} {what}: keys {sorted(state_dict)}, expected {sorted(want)}"
    )
    for name, full in want.items():
        value = state_dict[name]
        if sharded:
            _assert_2d_dtensor(ctx, f"{what} {name}", value)
        assert tuple(value.shape) == tuple(full.shape), (
            f"{ctx.where()} {what} {name}: shape {tuple(value.shape)}, expected the unsharded "
            f"{tuple(full.shape)}"
        )
        assert_close(ctx, f"{what} {name}", _full(value), full, FP32["param"])


def _assert_forward(ctx, what, model, oracle):
    dp = _dims(ctx)[0]
    x = torch.randn(dp * B, DIM, generator=torch.Generator().manual_seed(77)).to(ctx.device)
    mine = x[_mine(ctx)]
    with torch.no_grad():
        assert_close(ctx, f"{what}: forward", model(mine), oracle(mine), FP32["param"])


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(2, 4))
def tensor_parallel_train_state_dicts(ctx):
    """R69: FSDP1 over TP DTensor parameters trains like the unsharded model and saves and loads
    FULL and SHARDED state dicts holding its parameters.

    Losses of two Adam steps equal the oracle's; the FULL dict's values and the SHARDED dict's
    (DTensors on the (dp, tp) mesh) have the parameters' global shapes and the oracle's values;
    each dict loaded into a freshly built FSDP1 + TP model (other initial values) gives the
    oracle's forward, and the SHARDED-loaded model's FULL dict the oracle's values."""
    model, _, oracle, _ = _trained(ctx)
    full = _state_dict(ctx, model, "full")
    _assert_values(ctx, "FULL state_dict", full, oracle, sharded=False)
    sharded = _state_dict(ctx, model, "sharded")
    _assert_values(ctx, "SHARDED state_dict", sharded, oracle, sharded=True)
    for kind, state_dict in (("full", full), ("sharded", sharded)):
        fresh, _ = _build(ctx, seed=1)
        with _context(ctx, fresh, kind):
            fresh.load_state_dict(state_dict)
        what = f"after loading the {kind.upper()} state_dict"
        _assert_forward(ctx, what, fresh, oracle)
        if kind == "sharded":
            _assert_values(ctx, what, _state_dict(ctx, fresh, "full"), oracle, sharded=False)


def _osd(ctx, model, opt, kind):
    with _context(ctx, model, kind):
        return ctx.impl.ns.FullyShardedDataParallel.optim_state_dict(model, opt)


def _assert_osd(ctx, what, osd, oracle, oopt, sharded):
    """``osd`` holds ``oopt``'s state under the oracle's FQNs: ``step`` and both moments, each
    moment of the parameter's global shape (a DTensor on the (dp, tp) mesh when ``sharded``)."""
    names = sorted(n for n, _ in oracle.named_parameters())
    assert sorted(osd.get("state", {})) == names, (
        f"{ctx.where()} {what}: state keys {sorted(osd.get('state', {}))}, expected {names}"
    )
    listed = sorted(p for g in osd["param_groups"] for p in g["params"])
    assert listed == names, f"{ctx.where()} {what}: param_groups list {listed}, expected {names}"
    for name, param in oracle.named_parameters():
        mine, want = osd["state"][name], oopt.state[param]
        assert float(mine["step"]) == float(want["step"]), (
            f"{ctx.where()} {what} {name}: step {mine['step']}, expected {want['step']}"
        )
        for key, tol in STATE_TOL.items():
            value = mine[key]
            if sharded:
                _assert_2d_dtensor(ctx, f"{what} {name}.{key}", value)
            assert tuple(value.shape) == tuple(param.shape), (
                f"{ctx.where()} {what} {name}.{key}: shape {tuple(value.shape)}, expected the "
                f"parameter's {tuple(param.shape)}"
            )
            assert_close(ctx, f"{what} {name}.{key}", _full(value), want[key], tol)


OSD_REQUIRES = REQUIRES | {base.FSDP1_OPTIM_STATE_DICT}


@check(area="fsdp1_runtime", requires=OSD_REQUIRES, world_sizes=(2, 4))
def tensor_parallel_optim_state_dict(ctx):
    """R70: ``optim_state_dict`` of FSDP1 over TP DTensor parameters holds the unsharded Adam's
    state at the parameters' global shapes.

    After two Adam steps the FULL and SHARDED forms hold ``step`` and the moments of the
    unsharded optimizer under the FQNs, each moment of the parameter's global shape (not its TP
    shard's; SHARDED ones DTensors on the (dp, tp) mesh) with the unsharded optimizer's values."""
    model, opt, oracle, oopt = _trained(ctx)
    for kind in ("full", "sharded"):
        osd = _osd(ctx, model, opt, kind)
        _assert_osd(ctx, f"{kind.upper()} optim_state_dict", osd, oracle, oopt, kind == "sharded")


@check(area="fsdp1_runtime", requires=OSD_REQUIRES, world_sizes=(4,))
def tensor_parallel_optim_state_dict_load(ctx):
    """R70: an FSDP1 + TP optimizer state dict loads back through ``optim_state_dict_to_load``.

    The FULL and the SHARDED form of the trained model's ``optim_state_dict``, each given to
    ``optim_state_dict_to_load`` for a freshly built FSDP1 + TP model (other initial values; its
    state dict of the same kind loaded) and a new Adam, restore the unsharded optimizer's state:
    one more step gives the oracle's parameters."""
    model, opt, oracle, oopt = _trained(ctx)
    saved = {k: (_state_dict(ctx, model, k), _osd(ctx, model, opt, k)) for k in ("full", "sharded")}
    _step(ctx, oracle, oopt, STEPS, whole=True)
    for kind, (state_dict, osd) in saved.items():
        fresh, _ = _build(ctx, seed=1)
        fopt = torch.optim.Adam(fresh.parameters(), lr=LR)
        with _context(ctx, fresh, kind):
            fresh.load_state_dict(state_dict)
            flat = ctx.impl.ns.FullyShardedDataParallel.optim_state_dict_to_load(fresh, fopt, osd)
        fopt.load_state_dict(flat)
        _step(ctx, fresh, fopt, STEPS)
        what = f"one step after loading the {kind.upper()} optim_state_dict"
        _assert_values(ctx, what, _state_dict(ctx, fresh, "full"), oracle, sharded=False)
