"""Area "lifecycle": the package that defines FSDP2's public names.

[Note: the fully_shard package]
Upstream keeps FSDP2 in ``torch.distributed.fsdp._fully_shard`` and re-exports it from the
namespace. The package's ``__all__`` lists at least the six names of ``FSDP2_ALL`` (P24), so
``from <ns>._fully_shard import *`` gives every one of them, each the very object the namespace
exports under that name, and the namespace's own ``__all__`` lists them too. Upstream 2.13 lists
more (``DataParallelMeshDims``, ``register_fsdp_forward_method``, ``share_comm_ctx``): extra names
are allowed, a missing one is not.
"""

from __future__ import annotations

import importlib

from conformance.adapters import base
from conformance.registry import check

FSDP2_ALL = (
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
)


def _star_names(module_name: str) -> set[str]:
    """The names ``from <module_name> import *`` binds, as a user's module would see them."""
    scope: dict = {}
    exec(f"from {module_name} import *", scope)  # noqa: S102 - the import users write
    return {k for k in scope if not k.startswith("__")}


@check(area="lifecycle", requires={base.FSDP2_API}, world_sizes=(1,))
def fully_shard_package_exports(ctx):
    """P24: the namespace's ``_fully_shard`` package lists ``fully_shard``, ``FSDPModule``,
    ``UnshardHandle``, ``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy`` in
    ``__all__`` (``from <ns>._fully_shard import *`` gives each), each is the namespace's object of
    that name, and the namespace's ``__all__`` lists all six."""
    ns = ctx.impl.ns
    try:
        pkg = importlib.import_module(f"{ns.__name__}._fully_shard")
    except ModuleNotFoundError as exc:
        raise base.NotSupported(f"no {ns.__name__}._fully_shard package ({exc})") from exc
    missing = sorted(set(FSDP2_ALL) - set(getattr(pkg, "__all__", ())))
    assert not missing, f"{ctx.where()} {pkg.__name__}.__all__ lacks {missing}"
    missing = sorted(set(FSDP2_ALL) - _star_names(pkg.__name__))
    assert not missing, f"{ctx.where()} 'from {pkg.__name__} import *' does not give {missing}"
    for name in FSDP2_ALL:
        assert getattr(ns, name) is getattr(pkg, name), (
            f"{ctx.where()} {ns.__name__}.{name} is not {pkg.__name__}.{name}"
        )
    missing = sorted(set(FSDP2_ALL) - set(getattr(ns, "__all__", ())))
    assert not missing, f"{ctx.where()} {ns.__name__}.__all__ lacks {missing}"
