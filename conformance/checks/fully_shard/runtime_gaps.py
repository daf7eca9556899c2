"""Area "training": FSDP2 runtime edges of the communication setters and the iteration state
(P75, P76).

[Note: one allocation strategy per unit]
A unit's all-gather buffers come from one place: the default allocator, the process group's own
allocator (``set_allocate_memory_from_process_group_for_comm(True)``), symmetric memory
(``set_symm_mem_for_comm()``) or a custom comm. Once the process-group allocator is on,
``set_symm_mem_for_comm()`` refuses the unit with AssertionError naming the all-gather comm in
place (``ProcessGroupAllocAllGather``); turned off again (``False``), the unit is back on the
default all-gather and that refusal is gone (on CPU/gloo the symmetric-memory setup itself then
fails, NCCL being its only backend: any error but that AssertionError is accepted).
"""

from __future__ import annotations

from conformance.adapters import base
from conformance.checks._shared.oracle import MLP, PLANS
from conformance.registry import check


@check(
    area="training",
    requires={base.FSDP2_API, base.DTENSOR_PARAMS, base.FSDP2_SYMM_MEM},
    world_sizes=(1, 2),
)
def symm_mem_after_pg_allocator(ctx):
    """P75: on the nested MLP, ``inp.set_allocate_memory_from_process_group_for_comm(True)`` then
    ``inp.set_symm_mem_for_comm()`` raises AssertionError naming ``ProcessGroupAllocAllGather``
    (the all-gather comm in place); after ``...for_comm(False)`` the same call no longer raises
    that AssertionError."""
    ctx.seed(0)
    model = ctx.impl.shard(MLP().to(ctx.device), ctx, plan=PLANS["nested"])
    model.inp.set_allocate_memory_from_process_group_for_comm(True)
    try:
        model.inp.set_symm_mem_for_comm()
    except AssertionError as exc:
        assert "ProcessGroupAllocAllGather" in str(exc), (
            f"{ctx.where()} set_symm_mem_for_comm() after the process-group allocator: "
            f"AssertionError {exc!r} does not name the all-gather comm ProcessGroupAllocAllGather"
        )
    except Exception as exc:  # noqa: BLE001 - the wrong error is the finding
        raise AssertionError(
            f"{ctx.where()} set_symm_mem_for_comm() after the process-group allocator raised "
            f"{type(exc).__name__}: {exc}; expected AssertionError naming "
            "ProcessGroupAllocAllGather (the allocator's all-gather comm was not installed)"
        ) from exc
    else:
        raise AssertionError(
            f"{ctx.where()} set_symm_mem_for_comm() after "
            "set_allocate_memory_from_process_group_for_comm(True) raised nothing; expected "
            "AssertionError naming ProcessGroupAllocAllGather"
        )
    model.inp.set_allocate_memory_from_process_group_for_comm(False)
    try:
        model.inp.set_symm_mem_for_comm()
    except AssertionError as exc:
        raise AssertionError(
            f"{ctx.where()} set_symm_mem_for_comm() after "
            f"set_allocate_memory_from_process_group_for_comm(False) raised {exc!r}; the unit "
            "should be back on the default all-gather"
        ) from exc
    except Exception:  # noqa: BLE001, S110 - symmetric memory itself needs NCCL (module note)
        pass
