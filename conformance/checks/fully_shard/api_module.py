"""Areas "lifecycle" and "bad_input": the package that defines FSDP2's public names (P24), and
the call shape of the ``FSDPModule`` setters that take ``recurse`` (P66).

[Note: the fully_shard package]
Upstream keeps FSDP2 in ``torch.distributed.fsdp._fully_shard`` and re-exports it from the
namespace. The package's ``__all__`` lists at least the six names of ``FSDP2_ALL`` (P24), so
``from <ns>._fully_shard import *`` gives every one of them, each the very object the namespace
exports under that name, and the namespace's own ``__all__`` lists them too. Upstream 2.13 lists
more (``DataParallelMeshDims``, ``register_fsdp_forward_method``, ``share_comm_ctx``): extra names
are allowed, a missing one is not.

[Note: the setters' keyword-only recurse]
The ``FSDPModule`` setters that can act on one unit or on its whole subtree take that choice as a
keyword-only ``recurse`` (default True), after one value that binds by position or by name:
``set_reshard_after_backward``, ``set_requires_gradient_sync``, ``set_requires_all_reduce``,
``set_reduce_scatter_unused_params``, ``set_reduce_scatter_max_input_buffers`` and
``set_separate_reduce_scatter_group`` (whose value defaults to True). So
``unit.set_reshard_after_backward(reshard_after_backward=False, recurse=False)`` works and
``unit.set_reshard_after_backward(False, False)`` raises TypeError (too many positional arguments):
a positional False cannot be read as ``recurse`` by mistake. The list is written from the rule
(upstream 2.13's public signatures), never read off the implementation under test.
``set_reshard_after_forward`` is not in it: upstream takes its ``recurse`` by position too.
"""

from __future__ import annotations

import importlib

from torch import nn

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


# setter -> (the name of its value argument, a valid value); each takes ``recurse`` keyword-only
KEYWORD_RECURSE = {
    "set_reshard_after_backward": ("reshard_after_backward", False),
    "set_requires_gradient_sync": ("requires_gradient_sync", True),
    "set_reduce_scatter_unused_params": ("reduce_scatter_unused_params", False),
    "set_reduce_scatter_max_input_buffers": ("max_input_buffers", 1),
    "set_separate_reduce_scatter_group": ("enable", False),
}
_API = {base.FSDP2_API}


def _setter_check(fn):
    fn = check(
        area="bad_input",
        requires=_API,
        cases={name[4:].replace("_", "-"): {"setter": name} for name in KEYWORD_RECURSE},
        world_sizes=(1,),
    )(fn)
    return check(  # upstream's knob for HSDP's all-reduce: declared apart
        area="bad_input",
        requires=_API | {base.HSDP_ALL_REDUCE},
        cases={"requires-all-reduce": {"setter": "set_requires_all_reduce"}},
        world_sizes=(1,),
    )(fn)


@_setter_check
def setter_recurse_keyword_only(ctx, setter):
    """P66: ``unit.<setter>(<value>=v)`` and ``unit.<setter>(v, recurse=False)`` work, and
    ``unit.<setter>(v, False)`` (``recurse`` by position) raises TypeError "... positional
    arguments but 3 were given", for each setter of the module Note (value by name, recurse
    keyword-only), on ``fully_shard(Sequential(Linear(2, 2)))`` and on its child unit."""
    arg, value = KEYWORD_RECURSE.get(setter, ("requires_all_reduce", True))
    ctx.seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to(ctx.device)
    ctx.impl.ns.fully_shard(model[0], mesh=ctx.mesh)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    for where, unit in (("root", model), ("child", model[0])):
        method = getattr(unit, setter)
        for call, kwargs in (
            (f"{setter}({arg}={value!r})", {arg: value}),
            (f"{setter}({arg}={value!r}, recurse=False)", {arg: value, "recurse": False}),
        ):
            try:
                method(**kwargs)
            except TypeError as exc:
                raise AssertionError(
                    f"{ctx.where()} {where}.{call}: TypeError {exc}; the value binds by name "
                    "and recurse by keyword"
                ) from exc
        method(value, recurse=True)
        try:
            method(value, False)
        except TypeError as exc:
            assert "positional" in str(exc), (
                f"{ctx.where()} {where}.{setter}({value!r}, False): TypeError {exc!r} does not "
                "say 'positional'"
            )
        else:
            raise AssertionError(
                f"{ctx.where()} {where}.{setter}({value!r}, False) raised nothing; expected "
                "TypeError: recurse is keyword-only"
            )
