"""Area "fsdp1_runtime": what FSDP1's constructor says about its arguments (R30-R32)."""

from __future__ import annotations

import copy
import warnings

import torch

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet, full_params
from conformance.registry import check

REQUIRES = {base.FLAT_PARAM, base.FSDP1_API}


def _kwargs(ctx):
    return {"device_id": torch.device("cpu")} if ctx.device.type == "cpu" else {}


@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1,))
def world_size_one_warning(ctx):
    """R30: at world size 1 a unit built without ``sharding_strategy`` warns that it switches to
    NO_SHARD instead of ``FULL_SHARD`` (the default it was given), naming FULL_SHARD."""
    ns = ctx.impl.ns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns.FullyShardedDataParallel(InnerHeadNet().to(ctx.device), **_kwargs(ctx))
    texts = [str(w.message) for w in caught if "NO_SHARD" in str(w.message)]
    assert texts and all("FULL_SHARD" in t for t in texts), (
        f"{ctx.where()} the world-size-1 warnings {texts} should name FULL_SHARD, the strategy "
        "replaced by NO_SHARD"
    )


@check(
    area="fsdp1_runtime",
    requires=REQUIRES,
    cases={"empty": {"ignore": False}, "one_module": {"ignore": True}},
    world_sizes=(1, 2),
)
def ignored_states_list(ctx, ignore):
    """R31: ``ignored_states=[]`` acts as no ignored state (every parameter is flattened and
    sharded); ``ignored_states=[inner]`` leaves ``inner``'s parameters unmanaged: the very
    Parameter objects with their full shape and values, outside every flat parameter; in both
    cases the forward equals the unwrapped model's."""
    ns = ctx.impl.ns
    ctx.seed(0)
    oracle = InnerHeadNet().to(ctx.device)
    model = copy.deepcopy(oracle)
    inner_params = list(model.inner.parameters())
    states = [model.inner] if ignore else []
    fsdp = ns.FullyShardedDataParallel(model, ignored_states=states, **_kwargs(ctx))
    fqns = {f for fs, _ in ctx.impl.flat_shards(fsdp) for f in fs}
    want = {"head.weight", "head.bias"} | (set() if ignore else {"inner.weight", "inner.bias"})
    assert fqns == want, f"{ctx.where()} flattened {sorted(fqns)}, expected {sorted(want)}"
    if ignore:
        for p, ref in zip(inner_params, oracle.inner.parameters()):
            assert any(q is p for q in fsdp.parameters()), f"{ctx.where()} inner's param lost"
            assert_close(ctx, "ignored inner parameter", p, ref, FP32["param"])
    got = full_params(ctx, fsdp)
    for name in want:
        assert_close(ctx, name, got[name], oracle.get_parameter(name), FP32["param"])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5)).to(ctx.device)
    assert_close(ctx, "forward", fsdp(x), oracle(x), FP32["loss"])


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.FSDP1_HYBRID_SHARD},
    cases={"pg_not_groups": {"bad": "pg"}, "mesh_1d": {"bad": "mesh"}},
    world_sizes=(2,),
)
def hybrid_shard_bad_groups(ctx, bad):
    """R32: ``sharding_strategy=HYBRID_SHARD`` refuses with ValueError a ``process_group``
    that is not a pair of ProcessGroups (a tuple of two ints) and a ``device_mesh`` that is not
    2-D (a 1-D mesh over every rank), before any unit is built."""
    ns = ctx.impl.ns
    kwargs = {"sharding_strategy": ns.ShardingStrategy.HYBRID_SHARD, **_kwargs(ctx)}
    if bad == "pg":
        kwargs["process_group"] = (1, 2)
    else:
        kwargs["device_mesh"] = ctx.make_mesh((ctx.world_size,), ("shard",))
    model = InnerHeadNet().to(ctx.device)
    try:
        ns.FullyShardedDataParallel(model, **kwargs)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001 - the wrong exception is the finding
        raise AssertionError(
            f"{ctx.where()} HYBRID_SHARD with a bad {bad}: {type(e).__name__}: {e}, "
            "expected ValueError"
        ) from e
    else:
        raise AssertionError(f"{ctx.where()} HYBRID_SHARD with a bad {bad} was accepted")
