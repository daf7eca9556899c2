"""Finding implementations by name: built-ins, entry points, ``package.module:attr`` specs.

Resolution order for one spec string:
1. a built-in name (:data:`BUILTINS`);
2. an entry point of the group ``fsdp_conformance.implementations`` with that name
   (a vendor package declares ``[project.entry-points."fsdp_conformance.implementations"]
   my-fork = "my_fork.conformance:Adapter"``);
3. ``package.module:attr`` — ``attr`` is an :class:`Implementation` subclass (instantiated with no
   arguments), an instance, or a zero-argument factory returning one.

The default selection is ``$FSDP_CONFORMANCE_IMPL`` (comma-separated specs) when set, else every
built-in. Any failure raises :class:`ImplementationLoadError` naming the spec and the cause.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import traceback

from conformance.adapters.base import ALL_CAPABILITIES, Implementation

ENTRY_POINT_GROUP = "fsdp_conformance.implementations"
ENV_VAR = "FSDP_CONFORMANCE_IMPL"


def _torch_fsdp2():
    from conformance.adapters.fully_shard import FullyShardAdapter

    return FullyShardAdapter("torch.distributed.fsdp", name="torch-fsdp2")


def _torch_fsdp1():
    from conformance.adapters.flat_param import FlatParamAdapter

    return FlatParamAdapter("torch.distributed.fsdp", name="torch-fsdp1")


def _reference_fsdp2():
    from conformance.adapters import base
    from conformance.adapters.fully_shard import FullyShardAdapter

    impl = FullyShardAdapter("reference", name="reference", version=_reference_version())
    # reference/_fully_shard leaves HSDP accumulation, forward-method registration, custom
    # collectives and SPMD meshes (dp_mesh_dims) out (its package docstring; docs/adapters.md)
    impl.capabilities = impl.capabilities - {
        base.HSDP_ALL_REDUCE,
        base.FSDP2_FORWARD_METHOD,
        base.FSDP2_CUSTOM_COMMS,
        base.FSDP2_DP_MESH_DIMS,
        base.FSDP2_PER_PARAM_MESH,
        base.FSDP2_FUNCTORCH,
        base.FSDP2_PUBLIC_MODULE,
        base.FSDP2_SYMM_MEM,
        base.FSDP2_NEW_INIT_SWITCH,
    }
    return impl


def _reference_fsdp1():
    from conformance.adapters import base
    from conformance.adapters.flat_param import FlatParamAdapter

    impl = FlatParamAdapter("reference", name="reference-fsdp1", version=_reference_version())
    # reference/_fsdp1 has no optimizer state dicts, no HYBRID_SHARD and no ShardedGradScaler
    # (docs/adapters.md), and torch.distributed.checkpoint.state_dict recognizes only torch's own
    # FullyShardedDataParallel
    impl.capabilities = impl.capabilities - {
        base.FSDP1_OPTIM_STATE_DICT,
        base.FSDP1_HYBRID_SHARD,
        base.DCP_HELPERS,
        base.FSDP1_GRAD_SCALER,
        # nor the forward-order validation or forward prefetching (docs/adapters.md)
        base.FSDP1_EXEC_ORDER_CHECK,
        base.FSDP1_PREFETCH,
        base.FSDP1_MODULE_TO,
        base.FSDP1_FULL_PREC_IN_EVAL,
        base.FSDP1_CPU_OFFLOAD,
        base.FSDP1_FAKE_COLLECTIVES,  # profiling knobs that skip collectives
        base.FSDP1_TENSOR_PARALLEL,  # FlatParameter over DTensors (FSDP1's DTensor extensions)
        # no_sync() keeps its unsharded gradient inside the handle; LOCAL with use_orig_params is
        # refused (docs/adapters.md)
        base.FSDP1_NO_SYNC_ORIG_GRADS,
        base.FSDP1_LOCAL_ORIG_PARAMS,
        base.FSDP1_UNSAFE_SETATTR,
        # no marks for torch.compile on the modules it manages (docs/adapters.md)
        base.FSDP1_DYNAMO,
    }
    return impl


def _reference_version() -> str:
    import torch

    return f"project reference, on torch {torch.__version__}"


BUILTINS = {
    "torch-fsdp2": _torch_fsdp2,
    "torch-fsdp1": _torch_fsdp1,
    "reference": _reference_fsdp2,
    "reference-fsdp1": _reference_fsdp1,
}
DEFAULT_SELECTION = ("torch-fsdp2", "torch-fsdp1", "reference", "reference-fsdp1")


class ImplementationLoadError(Exception):
    """An implementation spec could not be turned into a working adapter."""


def default_specs() -> list[str]:
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return split_specs(env)
    return list(DEFAULT_SELECTION)


def split_specs(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _entry_points() -> dict:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_implementation(spec: str) -> Implementation:
    """Build the adapter for ``spec`` or raise :class:`ImplementationLoadError` (also when its
    ``inherits`` chain cannot be resolved)."""
    impl = _load(spec)
    lineage(impl)
    return impl


# every adapter loaded in this process, by name: a base named by ``inherits`` may be one of them
_LOADED: dict[str, Implementation] = {}
# implementation name -> its lineage (see :func:`lineage`), for callers that hold only the name
_LINEAGES: dict[str, tuple[str, ...]] = {}


def parent_name(impl) -> str | None:
    """The implementation ``impl`` inherits from (its ``inherits``), or None."""
    return getattr(impl, "inherits", None)


def lineage(impl) -> tuple[str, ...]:
    """``impl``'s name followed by the names it inherits from, nearest first, resolved
    transitively (``("acme-fsdp2", "torch-fsdp2")``): the deviation sets whose expectation entries,
    fuzz drops and steers apply to it. A base is found among the built-ins, the entry points and
    the adapters loaded before; one that cannot be found, or a cycle, raises
    :class:`ImplementationLoadError` naming the chain."""
    names = [impl.name]
    current = impl
    while (parent := parent_name(current)) is not None:
        if not isinstance(parent, str) or not parent:
            raise ImplementationLoadError(
                f"implementation {current.name!r}: inherits={parent!r} is not an implementation "
                f"name; set it to e.g. 'torch-fsdp2', or None to inherit nothing"
            )
        if parent in names:
            raise ImplementationLoadError(
                f"implementation {impl.name!r}: inherits forms a cycle "
                f"({' -> '.join([*names, parent])}); one of them must inherit nothing"
            )
        names.append(parent)
        current = _base(parent, names)
    _LINEAGES[impl.name] = tuple(names)
    return tuple(names)


def lineage_of(name: str) -> tuple[str, ...]:
    """The lineage of the implementation called ``name`` as loaded in this process (just
    ``(name,)`` for one never loaded here)."""
    return _LINEAGES.get(name, (name,))


def _base(name: str, chain: list[str]) -> Implementation:
    if name in _LOADED:
        return _LOADED[name]
    if name in BUILTINS or name in _entry_points():
        try:
            return _load(name)
        except ImplementationLoadError as exc:
            raise ImplementationLoadError(
                f"{' -> '.join(chain)}: the base {name!r} cannot be loaded: {exc}"
            ) from None
    known = sorted(BUILTINS) + sorted(_entry_points())
    raise ImplementationLoadError(
        f"{' -> '.join(chain)}: no implementation named {name!r} to inherit from (known: "
        f"{', '.join(known)}; or select it with --impl before the one that inherits it); fix "
        f"`inherits` on {chain[-2]!r}'s adapter"
    )


def _load(spec: str) -> Implementation:
    try:
        if spec in BUILTINS:
            obj = BUILTINS[spec]()
        elif spec in (eps := _entry_points()):
            obj = eps[spec].load()
        elif ":" in spec:
            module_name, _, attr = spec.partition(":")
            obj = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        else:
            known = sorted(BUILTINS) + sorted(_entry_points())
            raise ImplementationLoadError(
                f"unknown implementation {spec!r}: use one of {', '.join(known)}, an entry point of "
                f"group {ENTRY_POINT_GROUP!r}, or 'package.module:attr'"
            )
        if (
            isinstance(obj, type)
            and issubclass(obj, Implementation)
            or callable(obj)
            and not isinstance(obj, Implementation)
        ):
            obj = obj()
    except ImplementationLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the message carries the cause
        raise ImplementationLoadError(
            f"could not load implementation {spec!r}: {_cause(exc)}"
        ) from exc
    _validate(spec, obj)
    _LOADED.setdefault(obj.name, obj)
    return obj


def _cause(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of ``exc``, one line, naming where it was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}{where}"


def _validate(spec: str, impl) -> None:
    problems = []
    for attr in ("name", "capabilities", "version"):
        if not hasattr(type(impl), attr) and attr not in getattr(impl, "__dict__", {}):
            problems.append(f"missing attribute {attr!r}")
    if not problems:
        try:
            version = impl.version
            if not isinstance(version, str):
                problems.append(f"version is {type(version).__name__}, not a string")
        except Exception as exc:  # noqa: BLE001 - an adapter's bug is a load error, not a crash
            problems.append(f"reading its version raised {_cause(exc)}")
        unknown = set(impl.capabilities) - ALL_CAPABILITIES
        if unknown:
            problems.append(
                f"unknown capabilities {sorted(unknown)} (known: {sorted(ALL_CAPABILITIES)})"
            )
        inherits = getattr(impl, "inherits", None)
        if inherits is not None and (not isinstance(inherits, str) or inherits == impl.name):
            problems.append(
                f"inherits={inherits!r}: name another implementation (e.g. 'torch-fsdp2'), or None"
            )
        devices = getattr(impl, "devices", None)
        if devices is not None and (
            isinstance(devices, str) or not all(isinstance(d, str) and d for d in devices)
        ):
            problems.append(
                f"devices={devices!r}: give a set of device types, e.g. frozenset({{'cuda'}}), "
                f"or None for any"
            )
    if problems:
        raise ImplementationLoadError(
            f"implementation {spec!r} ({type(impl).__name__}) is not a valid adapter: "
            + "; ".join(problems)
        )
