"""Isolation between checks: the process-global state a check may change, and putting it back.

[Note: isolation between checks]
A worker rank runs thousands of checks (and the implementation under test) in one interpreter, so
whatever process-global state one check leaves behind would change the outcome of every later
check in that worker, and the result would depend on the order of the run. So around every check
the rank takes a :func:`snapshot` (after the implementation and the check module are loaded: what
an import sets up once is the module's own business) and afterwards :func:`settle` compares, puts
the state back and says what the check changed:

* reported and restored: the default dtype and device, grad mode, autocast (CPU and the
  accelerator), anomaly mode, deterministic algorithms (and ``warn_only``), the float32 matmul
  precision, the torch thread count, the ``torch.backends`` flags (cuDNN, CUDA matmul, mkldnn),
  the global hook dicts of ``torch.nn.modules.module`` and ``torch.optim.optimizer``
  (``register_module_forward_hook`` and friends), every function or class attribute of the
  modules in :data:`WATCHED_MODULES` (a monkeypatched ``torch.distributed.all_reduce``: replaced,
  removed or added), ``os.environ`` (but the harness's own ``FSDP_CONFORMANCE_*``) and the
  working directory;
* reported, and the worker recycled (the driver restarts the group, as after a hang): inference
  mode and the torch function / dispatch mode stacks (a mode entered and never left cannot be
  taken back from outside), and anything that is still different after the restore;
* restored silently: the CPU and accelerator RNG states, Python's ``random`` and numpy's global
  RNG: every check draws from them, so the next check starts from the same states whatever ran
  before it (a check that needs a particular stream seeds it, ``ctx.seed``);
* not watched: new ``sys.modules`` entries and new submodule attributes (lazy imports are fine).
  A check during which a module was imported for the first time may also add environment
  variables and watched attributes and decorate watched functions (the new value's
  ``__wrapped__`` is the old one): that is the module's set-up (``torch._inductor`` sets
  ``TORCHINDUCTOR_CACHE_DIR``, ``torch._dynamo`` wraps ``torch.manual_seed``), taken as the new
  baseline; so such a check's own additions of that kind go unseen (a limit). Also not watched:
  ``warnings`` filters, threads and file descriptors (bounded by the pool, [Note: bounded ranks]),
  process groups (released by the ledger, [Note: per-check cleanup]), and any module not listed.

A leak fails the leaking check, on the rank that leaked: its result becomes an error whose
message reads ``StateLeak: state leaked: default dtype torch.float32 -> torch.float64`` (one line
per change; an expectations entry pins it with ``raises=StateLeak``). An implementation that
legitimately sets global state once (a vendor's global module hook, say) declares it as data on its
adapter: ``allowed_global_state``, a tuple of :mod:`fnmatch` patterns over the labels used in the
messages (``("torch.nn.modules.module._global_forward_pre_hooks",)``); a change to a matching
label is neither reported nor undone.
"""

from __future__ import annotations

import fnmatch
import os
import random
import sys
from dataclasses import dataclass, field
from types import ModuleType

import torch

# Modules whose function and class attributes are watched (a monkeypatch of one is a leak).
WATCHED_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.nn.functional",
)
# Global hook registries: (module, attribute); each a dict of handle id -> hook.
HOOK_DICTS = tuple(
    ("torch.nn.modules.module", name)
    for name in (
        "_global_buffer_registration_hooks",
        "_global_module_registration_hooks",
        "_global_parameter_registration_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
    )
) + (
    ("torch.optim.optimizer", "_global_optimizer_pre_hooks"),
    ("torch.optim.optimizer", "_global_optimizer_post_hooks"),
)
# torch.backends flags: (module, attribute)
BACKEND_FLAGS = (
    ("torch.backends.cudnn", "enabled"),
    ("torch.backends.cudnn", "benchmark"),
    ("torch.backends.cudnn", "deterministic"),
    ("torch.backends.cudnn", "allow_tf32"),
    ("torch.backends.mkldnn", "enabled"),
)
# The harness's own: the save-job forkserver's starter pid (conformance.runner.lifeline).
HARNESS_STATE = ("environment variable FSDP_CONFORMANCE_*",)
_MISSING = object()


class StateLeak(Exception):
    """A check left process-global state changed (see [Note: isolation between checks])."""


@dataclass
class Snapshot:
    values: dict[str, object]  # label -> comparable value (restored by _SETTERS)
    attributes: dict[str, dict[str, object]]  # watched module -> a copy of its __dict__
    hooks: dict[tuple[str, str], dict]  # hook registry -> a copy of it
    environ: dict[str, str]
    modules: int  # len(sys.modules): whether the check imported something
    rng: dict[str, object] = field(default_factory=dict)  # restored silently


def _accelerator():
    """The accelerator's device module when one is initialised in this process, else None (a
    snapshot never initialises a device)."""
    accel = getattr(torch, "accelerator", None)
    try:
        kind = accel.current_accelerator() if accel is not None else None
    except RuntimeError:
        return None
    if kind is None:
        return None
    module = getattr(torch, kind.type, None)
    initialized = getattr(module, "is_initialized", None)
    return module if initialized is not None and initialized() else None


def _values() -> dict[str, object]:
    values = {
        "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly mode": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "torch threads": torch.get_num_threads(),
        "cpu autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "torch function modes": torch._C._len_torch_function_stack(),
        "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
        "working directory": os.getcwd(),
    }
    accel = _accelerator()
    if accel is not None:
        kind = torch.accelerator.current_accelerator().type
        values[f"{kind} autocast"] = (
            torch.is_autocast_enabled(kind),
            torch.get_autocast_dtype(kind),
        )
    for module, name in BACKEND_FLAGS:
        values[f"{module}.{name}"] = getattr(sys.modules[module], name, None)
    mm = sys.modules["torch.nn.modules.module"]
    values["torch.nn.modules.module._global_is_full_backward_hook"] = (
        mm._global_is_full_backward_hook
    )
    return values


def _watched(value) -> bool:
    """A module attribute whose change is a leak: a function or class (not a submodule, not a
    counter or cache the module keeps)."""
    return value is not _MISSING and callable(value) and not isinstance(value, ModuleType)


def snapshot() -> Snapshot:
    """The process-global state now (cheap: well under a millisecond)."""
    import torch.backends.cudnn  # noqa: F401 - BACKEND_FLAGS' modules
    import torch.backends.mkldnn  # noqa: F401
    import torch.optim.optimizer  # noqa: F401

    rng: dict[str, object] = {"cpu": torch.get_rng_state(), "random": random.getstate()}
    accel = _accelerator()
    if accel is not None:
        rng["accelerator"] = accel.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        rng["numpy"] = numpy.random.get_state()
    return Snapshot(
        values=_values(),
        attributes={
            name: vars(sys.modules[name]).copy() for name in WATCHED_MODULES if name in sys.modules
        },
        hooks={key: dict(getattr(sys.modules[key[0]], key[1])) for key in HOOK_DICTS},
        environ=dict(os.environ),
        modules=len(sys.modules),
        rng=rng,
    )


def _set_default_device(device) -> None:
    torch.set_default_device(None if device == torch.device("cpu") else device)


def _set_autocast(kind: str):
    def setter(value) -> None:
        enabled, dtype = value
        torch.set_autocast_enabled(kind, enabled)
        torch.set_autocast_dtype(kind, dtype)

    return setter


def _set_backend_flag(label: str):
    module, _, name = label.rpartition(".")

    def setter(value) -> None:
        setattr(sys.modules[module], name, value)

    return setter


# label -> how to put it back; a label without a setter can only be reset by a recycle
_SETTERS = {
    "default dtype": torch.set_default_dtype,
    "default device": _set_default_device,
    "grad mode": torch.set_grad_enabled,
    "anomaly mode": lambda v: torch.set_anomaly_enabled(v[0], v[1]),
    "deterministic algorithms": lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    "float32 matmul precision": torch.set_float32_matmul_precision,
    "torch threads": torch.set_num_threads,
    "cpu autocast": _set_autocast("cpu"),
    "working directory": os.chdir,
    "torch.nn.modules.module._global_is_full_backward_hook": lambda v: setattr(
        sys.modules["torch.nn.modules.module"], "_global_is_full_backward_hook", v
    ),
    **{f"{m}.{n}": _set_backend_flag(f"{m}.{n}") for m, n in BACKEND_FLAGS},
}


def _setter(label: str):
    if label in _SETTERS:
        return _SETTERS[label]
    if label.endswith(" autocast"):
        return _set_autocast(label.removesuffix(" autocast"))
    return None


def _show(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
    return str(value)


@dataclass
class Outcome:
    leaks: list[str]  # "<label> <before> -> <after>", one per change reported
    recycle: bool  # state that could not be put back: the worker must be restarted

    def message(self) -> str:
        """The leak as an error text whose exception :mod:`conformance.expectations` can read."""
        return "Traceback (most recent call last):\n  (after the check)\nStateLeak: " + "\n".join(
            f"state leaked: {leak}" for leak in self.leaks
        )


def settle(before: Snapshot, allowed: tuple[str, ...] = ()) -> Outcome:
    """Compare the state now with ``before``, put it back (but for ``allowed`` labels), and say
    what changed (see [Note: isolation between checks])."""
    allowed = (*allowed, *HARNESS_STATE)
    ok = lambda label: any(fnmatch.fnmatchcase(label, p) for p in allowed)  # noqa: E731
    leaks: list[str] = []
    recycle = False
    imported = len(sys.modules) != before.modules  # the check imported a module
    # RNG: silently
    torch.set_rng_state(before.rng["cpu"])
    random.setstate(before.rng["random"])
    if "accelerator" in before.rng:
        accel = _accelerator()
        if accel is not None:
            accel.set_rng_state_all(before.rng["accelerator"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in before.rng:
        numpy.random.set_state(before.rng["numpy"])
    # plain values
    deferred = []  # no setter: judged after the rest is back (a default device is a mode)
    for label, value in _values().items():
        old = before.values.get(label, _MISSING)
        if old is _MISSING or old == value or ok(label):
            continue
        setter = _setter(label)
        if setter is None:
            deferred.append(label)
            continue
        leaks.append(f"{label} {_show(old)} -> {_show(value)}")
        try:
            setter(old)
        except Exception:  # noqa: BLE001 - cannot put it back: the check below recycles
            pass
    # global hooks
    for (module, name), old in before.hooks.items():
        registry = getattr(sys.modules[module], name)
        label = f"{module}.{name}"
        if list(registry) == list(old) or ok(label):
            continue
        added = [_show(registry[k]) for k in registry if k not in old]
        removed = [_show(old[k]) for k in old if k not in registry]
        change = ", ".join(
            [f"added {', '.join(added)}"] * bool(added)
            + [f"removed {', '.join(removed)}"] * bool(removed)
        )
        leaks.append(f"{label} {change or 'reordered'}")
        registry.clear()
        registry.update(old)
    # watched module attributes
    for module_name, old in before.attributes.items():
        module = sys.modules[module_name]
        now = vars(module)
        try:
            if now == old:  # identical values compare equal without a call: cheap
                continue
        except Exception:  # noqa: BLE001, S110 - a value whose == raises: compare one by one
            pass
        changed = [k for k, v in now.items() if old.get(k, _MISSING) is not v]
        changed += [k for k in old if k not in now]
        for name in changed:
            was, value = old.get(name, _MISSING), now.get(name, _MISSING)
            label = f"{module_name}.{name}"
            if not (_watched(was) or _watched(value)) or ok(label):
                continue
            if imported and getattr(value, "__wrapped__", None) is was:
                continue  # an import during the check decorated it (torch._dynamo does)
            if was is _MISSING:
                if imported:
                    continue  # a module imported during the check defined it
                leaks.append(f"{label} added ({_show(value)})")
                delattr(module, name)
            elif value is _MISSING:
                leaks.append(f"{label} removed (was {_show(was)})")
                setattr(module, name, was)
            else:
                leaks.append(f"{label} replaced: {_show(was)} -> {_show(value)}")
                setattr(module, name, was)
    # environment
    env = os.environ
    if env != before.environ:
        for key in sorted(set(before.environ) | set(env)):
            was, value = before.environ.get(key), env.get(key)
            label = f"environment variable {key}"
            if was == value or ok(label) or (was is None and imported):
                continue  # (a module imported during the check may set a variable up once)
            leaks.append(
                f"{label} {'unset' if was is None else repr(was)} -> "
                f"{'unset' if value is None else repr(value)}"
            )
            if was is None:
                del env[key]
            else:
                env[key] = was
    if leaks or deferred:  # what could not be put back needs a fresh process
        now = _values()
        for label in deferred:
            if now.get(label) != before.values[label]:
                leaks.append(f"{label} {_show(before.values[label])} -> {_show(now.get(label))}")
        recycle = any(
            now.get(label) != value for label, value in before.values.items() if not ok(label)
        )
    return Outcome(leaks, recycle)
