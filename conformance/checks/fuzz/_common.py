"""Helpers of the fuzz area's checks (:mod:`.fuzz`, :mod:`.state_dict`): building an example's
sharded model and its oracle, training both, and what the trained model must hold.

Expected values come from the rules (rows from ``ceil(d/ws)``, flat elements from ``ceil(N/ws)``)
and from an unsharded copy of the model trained in one process on the global batch (the oracle),
never from the implementation under test. Tolerances: fp32 losses and parameters
``rtol=1e-4, atol=1e-4`` (see ``FP32``); with mixed precision, losses within ``rtol=3e-2`` and every
parameter within 25% of the model's largest fp32 update (norm) + 1e-3 of the oracle's after the
steps (``MP_TOL``).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.oracle import assert_close, local_chunk
from conformance.checks._shared.rows import chunk_size
from conformance.checks._shared.sd_models import assert_loaded, expected_state_dict, full_params
from conformance.fuzz import model as fm
from conformance.fuzz import strategies as fs

# fp32: absolute 1e-4 as well, since a random model of narrow layers can amplify rounding; a fault
# (a missing average, a wrong row) is off by far more
FP32 = {"loss": dict(rtol=1e-4, atol=1e-4), "param": dict(rtol=1e-4, atol=1e-4)}
# mixed precision: within a quarter of the model's largest fp32 update, plus 1e-3 (bf16 rounds the
# parameters themselves by ~4e-3 relative, which tiny updates of a random model do not dominate);
# a missing or doubled divide is off by 100% of the update
MP_TOL = {"loss": dict(rtol=3e-2, atol=1e-2), "update": 0.25, "atol": 1e-3}
# micro-batch m < accumulate of step s trains on the batch of index ACCUMULATE_BATCHES*(m+1)+s
ACCUMULATE_BATCHES = 100
NO_TRAINING = fs.ALL_FEATURES - {
    fs.PREFETCH,
    fs.ACCUMULATE,
    fs.ORIG_PARAMS,
    fs.TRAINING,
    fs.CPU_OFFLOAD,
    fs.RANK0_ONLY,
    fs.ASSIGN,
    fs.HSDP,
    fs.DIVIDE_FACTOR,
}  # layout's


def shard(ctx, example: dict, salt: int = 0, impl=None, plain: bool = False):
    """(sharded model, unsharded oracle copy) for ``example``; ``plain``: without the example's
    options (for another implementation than the one they were drawn for)."""
    impl = impl or ctx.impl
    model = fm.build(example, salt).to(ctx.device)
    oracle = copy.deepcopy(model)
    options = {} if plain else fm.shard_options(example, model)
    if example.get("mesh") and not plain:
        options["mesh"] = ctx.make_mesh(tuple(example["mesh"]), ("replicate", "shard"))
    plan = fm.plan(example, plain)
    if example.get("unit_knobs") and not plain:
        plan = [
            (unit, {**kwargs, **fm.knob_kwargs(example, unit, impl.ns)}) for unit, kwargs in plan
        ]
        if example.get("fsdp1_mesh"):  # hybrid units: every one on the same 2-D mesh
            mesh = ctx.make_mesh(tuple(example["fsdp1_mesh"]), ("replicate", "shard"))
            plan = [(unit, {**kwargs, "device_mesh": mesh}) for unit, kwargs in plan]
    sharded = impl.shard(model, ctx, plan=plan, **options)
    if not plain:
        for unit, factor in example.get("divide_factors", {}).items():
            sharded.get_submodule(unit).set_gradient_divide_factor(factor)
    return sharded, oracle


def flat_units(example: dict, oracle) -> list[str]:
    """The FSDP1 units of ``example``: its wrap plan and the root, and, when mixed precision meets a
    wrap plan, every batch norm (W11)."""
    units = set(example["wrap"]) | {""}
    if example["wrap"] and example.get("options", {}).get("mixed_precision"):  # W11
        units |= {n for n, m in oracle.named_modules() if isinstance(m, fm.BatchNormLeaf)}
    return sorted(units)


def shard_groups(example: dict, oracle, world_size: int) -> dict[str, int]:
    """Parameter FQN (first names) -> the size of the group its FSDP1 unit shards it over (R19:
    1 under NO_SHARD, else the world size); see :func:`conformance.fuzz.model.shard_group_sizes`."""
    units = flat_units(example, oracle)
    sizes = fm.shard_group_sizes(example, units, world_size)
    return {f: sizes[u] for u, fqns in fm.managed(oracle, units).items() for f in fqns}


def owner(path: str, units: list[str]) -> str:
    """The unit that manages what the module at ``path`` holds: the deepest unit containing it."""
    inside = [u for u in units if u == "" or path == u or path.startswith(u + ".")]
    return max(inside, key=lambda u: (u.count(".") + 1 if u else 0, len(u)))


def name_groups(example: dict, oracle, world_size: int) -> dict[str, int]:
    """:func:`shard_groups` for every parameter name, tied aliases too, and every buffer name (its
    module's unit)."""
    units = flat_units(example, oracle)
    sizes = fm.shard_group_sizes(example, units, world_size)
    out = {n: sizes[owner(n.rpartition(".")[0], units)] for n, _ in oracle.named_buffers()}
    groups, first = shard_groups(example, oracle, world_size), {}
    for name, p in oracle.named_parameters(remove_duplicate=False):
        out[name] = groups[first.setdefault(id(p), name)]
    return out


def grad_scales(example: dict, oracle, world_size: int) -> dict[str, float]:
    """Oracle parameter name -> the factor its gradient (of the mean loss over the global batch)
    takes in the sharded model: each rank's gradient is of its own mean loss, so the SUM over the
    ranks divided by a unit's divide factor f is ``ws / f`` times the oracle's gradient (1 with the
    default factor, the data-parallel size ws, on a 1-D or an HSDP mesh alike) (P6, P16)."""
    factors = example.get("divide_factors", {})
    units = fm.managed(oracle, example["wrap"] + [""])
    return {
        fqn: world_size / factors[unit]
        for unit, fqns in units.items()
        if unit in factors
        for fqn in fqns
    }


def train(ctx, model, oracle, example: dict, steps: int) -> None:
    """``steps`` SGD steps of the sharded model (rank r: samples r*B..(r+1)*B of the global batch)
    and of the oracle (the whole batch, its gradients scaled by :func:`grad_scales`); rank r's loss
    must equal the oracle's on its samples. With ``example["accumulate"]`` = k, each step runs k
    micro-batches (other batches) under the root's ``no_sync()`` before the synced one: the oracle
    accumulates the gradients of all k + 1 (R45)."""
    low = bool(example.get("options", {}).get("mixed_precision"))
    opt = torch.optim.SGD(model.parameters(), lr=fm.LR)
    oopt = torch.optim.SGD(oracle.parameters(), lr=fm.LR)
    mine = slice(ctx.rank * fm.B, (ctx.rank + 1) * fm.B)
    scales = grad_scales(example, oracle, ctx.world_size)
    accumulate = example.get("accumulate", 0)
    for step in range(steps):
        for micro in range(accumulate + 1):  # the last one synced, the others under no_sync()
            synced = micro == accumulate
            index = step if synced else ACCUMULATE_BATCHES * (micro + 1) + step
            x, t, y = fm.batch(example, ctx.world_size, index, ctx.device, oracle.out_width)
            with contextlib.nullcontext() if synced else model.no_sync():
                loss = fm.per_sample_loss(model(x[mine], t[mine]), y[mine]).mean()
                loss.backward()
            oloss = fm.per_sample_loss(oracle(x, t), y)
            oloss.mean().backward()  # accumulates: the oracle's gradient is the micro-batches' sum
            what = f"step {step} loss" + ("" if synced else f" (micro-batch {micro}, no_sync)")
            assert_close(
                ctx, what, loss, oloss[mine].mean(), MP_TOL["loss"] if low else FP32["loss"]
            )
        with torch.no_grad():
            for name, p in oracle.named_parameters():
                if name in scales and p.grad is not None:
                    p.grad.mul_(scales[name])
        for o in (opt, oopt):
            o.step()
            o.zero_grad()


def oracle_params(oracle) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in oracle.named_parameters()}


def placement_dims(example: dict, oracle) -> dict[str, int]:
    """Every parameter name (tied aliases too) -> the dim it is sharded on."""
    first = {}
    for name, p in oracle.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    placements = example.get("placements", {})
    return {
        name: placements.get(first[id(p)], 0)
        for name, p in oracle.named_parameters(remove_duplicate=False)
    }


def gathered(ctx, model, impl=None) -> dict[str, torch.Tensor]:
    """Every full parameter of a sharded model: ``full_tensor()`` of DTensor parameters (any
    placement), else reassembled from the layout view (``full_params``)."""
    impl = impl or ctx.impl
    if base.DTENSOR_PARAMS in impl.capabilities:  # an empty parameter has nothing to gather (and
        # torch 2.13 cannot gather a zero-trailing one: layout::per_param_dim0_*[*-zero-trailing-)
        return {
            impl.clean_fqn(n): p.detach().full_tensor().cpu() if p.numel() else torch.zeros(p.shape)
            for n, p in model.named_parameters()
        }
    return full_params(ctx, model, impl)


def saved_values(ctx, example: dict, model, oracle) -> dict[str, torch.Tensor]:
    """What a state dict of the trained sharded ``model`` must hold, key by key (tied aliases
    included): its parameters (gathered, independent of the state-dict code) and
    :func:`saved_buffers`."""
    params = gathered(ctx, model)
    first, out = {}, {}
    for name, p in oracle.named_parameters(remove_duplicate=False):
        out[name] = params[first.setdefault(id(p), name)]
    return {**out, **saved_buffers(example, oracle)}


def saved_buffers(example: dict, oracle, restore_dtype: bool = True) -> dict[str, torch.Tensor]:
    """The oracle's persistent buffers as a state dict of the sharded model holds them, in their
    own dtype; with FSDP1 buffer mixed precision, the module's buffers were cast to
    ``buffer_dtype``, so the saved fp32 value is the rounded one (S12), except in batch norms that a
    wrap policy made fp32 units of their own (W11); without ``restore_dtype`` (a LOCAL dict, whose
    hook leaves buffers alone) such a buffer is saved as the module holds it, in ``buffer_dtype``."""
    mp = example.get("options", {}).get("mixed_precision") or {}
    low = getattr(torch, mp["buffer_dtype"]) if mp.get("buffer_dtype") else None
    fp32_units = (
        {n for n, m in oracle.named_modules() if isinstance(m, fm.BatchNormLeaf)}
        if example["wrap"]
        else set()
    )
    params = {n for n, _ in oracle.named_parameters(remove_duplicate=False)}
    out = {}
    for name, value in expected_state_dict(oracle).items():
        if name in params:
            continue
        cast = low and value.is_floating_point() and name.rpartition(".")[0] not in fp32_units
        if cast:
            value = value.to(low).to(value.dtype) if restore_dtype else value.to(low)
        out[name] = value
    return out


def assert_restored(ctx, model, expected: dict, what: str, impl=None) -> None:
    """The sharded ``model``'s parameters (gathered any placement) and persistent buffers equal
    ``expected``."""
    assert_loaded(ctx, model, expected, what, impl, params=gathered(ctx, model, impl))


def assert_per_param_layout(
    ctx, model, originals: dict, example: dict, what: str = "", views_padded: bool = False
) -> None:
    """Every parameter of the per-parameter-sharded ``model`` holds its dim-0 (or placed dim's)
    chunk of ``originals`` (rows of ceil(d/ws)); a padded storage is ceil(d0/ws) rows with a zero
    tail (P1, P7) and, with ``views_padded``, the local shard is a view of it (P9)."""
    what = f" {what}" if what else ""
    views = ctx.impl.local_shards(model)  # keyed by clean FQN
    assert set(views) == set(originals), (
        f"{ctx.where()}{what} parameters {sorted(views)} != {sorted(originals)}"
    )
    for fqn, orig in originals.items():
        dim = example.get("placements", {}).get(fqn, 0)
        expected = local_chunk(orig, dim, ctx.world_size, ctx.rank)
        local = views[fqn].local.detach().cpu()
        if orig.numel() == 0:  # no values to place (zero-trailing shapes: layout.py's cases)
            assert local.numel() == 0, (
                f"{ctx.where()}{what} {fqn}: {local.numel()} local elements of an empty parameter"
            )
            continue
        assert local.shape == expected.shape and torch.equal(local, expected), (
            f"{ctx.where()}{what} {fqn} {tuple(orig.shape)} Shard({dim}): local shard {tuple(local.shape)} "
            f"{local.reshape(-1)[:4].tolist()}, expected its chunk {tuple(expected.shape)} "
            f"{expected.reshape(-1)[:4].tolist()}"
        )
        padded = views[fqn].padded
        if dim == 0 and base.PADDED_STORAGE in ctx.impl.capabilities and padded is not None:
            rows = chunk_size(orig.shape[0], ctx.world_size)
            want = rows * fm.numel(orig.shape[1:])
            assert padded.numel() == want, (
                f"{ctx.where()}{what} {fqn}: padded storage of {padded.numel()} elements, expected {want}"
            )
            assert not padded.detach().cpu()[expected.numel() :].any(), (
                f"{ctx.where()}{what} {fqn}: padding after element {expected.numel()} is not zero"
            )
            if views_padded and local.numel():
                storage = views[fqn].local.untyped_storage().data_ptr()
                assert storage == padded.untyped_storage().data_ptr(), (
                    f"{ctx.where()}{what} {fqn}: the local shard is not a view of the padded storage"
                )


def assert_trained(ctx, example: dict, model, oracle, before: dict, steps: int) -> None:
    """After ``steps`` steps from ``before`` (the oracle's parameters), the sharded ``model``'s
    gathered parameters equal the oracle's (fp32), or (mixed precision) are within 25% of the
    largest fp32 update + 1e-3 of them."""
    got, want = gathered(ctx, model), oracle_params(oracle)
    low = bool(example.get("options", {}).get("mixed_precision"))
    # low precision: compared with the model's largest fp32 update (a parameter whose gradient is
    # numerically zero, e.g. behind a 1- or 2-wide LayerNorm, has only rounding noise to update)
    scale = max((v - before[n]).norm().item() for n, v in want.items())
    for fqn, value in want.items():
        if not low:
            assert_close(ctx, f"{fqn} after {steps} steps", got[fqn], value, FP32["param"])
            continue
        err = (got[fqn] - value).float().norm().item()
        assert err <= MP_TOL["update"] * scale + MP_TOL["atol"], (
            f"{ctx.where()} {fqn}: after {steps} mixed-precision steps the parameters are "
            f"{err:.3g} (norm) from the fp32 oracle's, more than 25% of the largest update "
            f"{scale:.3g} + 1e-3"
        )


def _kind(impl, kind: str) -> str:
    """The implementation's state-dict kind for a FULL or SHARDED dict (FSDP1 or FSDP2 style)."""
    caps = impl.capabilities
    if kind == "full":
        if base.FULL_STATE_DICT in caps:
            return "full"
        if base.DTENSOR_STATE_DICT in caps:
            return "dcp-full"
    elif kind == "local":
        if base.LOCAL_STATE_DICT in caps:
            return "local"
        raise NotSupported.undeclared(base.LOCAL_STATE_DICT)
    elif base.SHARDED_STATE_DICT in caps:
        return "sharded"
    elif base.DTENSOR_STATE_DICT in caps:
        return "dtensor"
    raise NotSupported.undeclared(
        base.FULL_STATE_DICT if kind == "full" else base.SHARDED_STATE_DICT,
        base.DTENSOR_STATE_DICT,
        any_of=True,
    )
