"""Area "state_dict": a NO_SHARD unit answers FULL but keeps the type the user set (S8).

[Note: NO_SHARD keeps the user's state-dict type]
Under NO_SHARD (a ``sharding_strategy=NO_SHARD`` unit, or any unit at world size 1) every
state-dict type is served as FULL with the default ``FullStateDictConfig`` (S8). That substitution
lasts only for the save or load: afterwards ``FSDP.get_state_dict_type(model)`` still reports the
type and config set with ``set_state_dict_type`` (here SHARDED with ``offload_to_cpu=True``), on
every unit, after ``state_dict()`` and after ``load_state_dict()``.
"""

from __future__ import annotations

import warnings

from conformance.adapters import base
from conformance.checks._shared.sd_models import AREA, Net, assert_loaded, plain_reference
from conformance.registry import check


@check(area=AREA, requires={base.FSDP1_API, base.FLAT_PARAM, base.SHARDED_STATE_DICT})
def no_shard_keeps_state_dict_type(ctx):
    """S8: after ``set_state_dict_type(model, SHARDED, ShardedStateDictConfig(offload_to_cpu=True))``
    on a NO_SHARD model, ``state_dict()`` and ``load_state_dict()`` (served as FULL) leave
    ``get_state_dict_type(model)`` at SHARDED with that config, and the load restores the values."""
    ns = ctx.impl.ns
    fsdp, kind = ns.FullyShardedDataParallel, ns.StateDictType.SHARDED_STATE_DICT
    no_shard = {"sharding_strategy": ns.ShardingStrategy.NO_SHARD}
    plan = [("inner", no_shard), ("scale", no_shard), ("", no_shard)]
    model = ctx.impl.shard(Net(0).to(ctx.device), ctx, plan=plan)
    fsdp.set_state_dict_type(model, kind, ns.ShardedStateDictConfig(offload_to_cpu=True))

    def assert_kept(m, after: str) -> None:
        settings = fsdp.get_state_dict_type(m)
        config = settings.state_dict_config
        assert settings.state_dict_type == kind, (
            f"{ctx.where()} after {after} on a NO_SHARD model get_state_dict_type() is "
            f"{settings.state_dict_type}, expected the SHARDED_STATE_DICT set before"
        )
        assert isinstance(config, ns.ShardedStateDictConfig) and config.offload_to_cpu, (
            f"{ctx.where()} after {after} the state_dict_config is {config!r}, expected the "
            "ShardedStateDictConfig(offload_to_cpu=True) set before"
        )
        for unit in fsdp.fsdp_modules(m):
            assert unit._state_dict_type == kind, (
                f"{ctx.where()} after {after} a unit's _state_dict_type is "
                f"{unit._state_dict_type}, expected SHARDED_STATE_DICT"
            )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NO_SHARD warning (S8's check asserts it)
        sd = model.state_dict()
        assert_kept(model, "state_dict()")
        dst = ctx.impl.shard(Net(1).to(ctx.device), ctx, plan=plan)
        fsdp.set_state_dict_type(dst, kind, ns.ShardedStateDictConfig(offload_to_cpu=True))
        dst.load_state_dict(sd)
        assert_kept(dst, "load_state_dict()")
    assert_loaded(ctx, dst, plain_reference(Net, 0), "after a NO_SHARD load")
