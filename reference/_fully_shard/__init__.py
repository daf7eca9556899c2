"""FSDP2, per-parameter sharding: a readable reference of ``torch.distributed.fsdp.fully_shard``.

Reading order: ``_shard_math`` (sizes, padding), ``_fsdp_api`` (policies), ``_fsdp_common``
(meshes, states), ``_fsdp_param`` (one parameter), ``_fsdp_extensions`` (all-gather extension
hooks), ``_fsdp_collectives`` (all-gather, reduce-scatter), ``_fsdp_param_group`` (one call's
parameters), ``_fsdp_state`` (hooks, root, lazy init), ``_fsdp_init`` (argument checks),
``_fully_shard`` (the API), ``_comm_ctx`` (``share_comm_ctx``).

Left out, deliberately: per-parameter meshes and 2-D (EP + TP) parameter meshes (both rejected
with ``NotImplementedError``); full SPMD meshes (``dp_mesh_dims``); CUDA streams and other overlap
machinery; ``torch.compile`` support; and the ``FSDPModule`` methods that only tune those or HSDP
accumulation (``set_requires_all_reduce``, ``set_post_optim_event``, custom all-gather /
reduce-scatter). Explicit prefetching (``set_modules_to_*_prefetch``) only reorders the
synchronous all-gathers; the stream and buffer dials (``set_is_last_backward``,
``set_reduce_scatter_max_input_buffers``, ``set_allocate_memory_from_process_group_for_comm``) are
stored and validated but change nothing here.
"""

from ._comm_ctx import share_comm_ctx
from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]
__all__ += ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "share_comm_ctx"]
