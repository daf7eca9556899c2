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
    from conformance.adapters.fully_shard import FullyShardAdapter

    return FullyShardAdapter("reference", name="reference", version=_reference_version())


def _reference_fsdp1():
    from conformance.adapters.flat_param import FlatParamAdapter

    return FlatParamAdapter("reference", name="reference-fsdp1", version=_reference_version())


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
    """Build the adapter for ``spec`` or raise :class:`ImplementationLoadError`."""
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
    if problems:
        raise ImplementationLoadError(
            f"implementation {spec!r} ({type(impl).__name__}) is not a valid adapter: "
            + "; ".join(problems)
        )
