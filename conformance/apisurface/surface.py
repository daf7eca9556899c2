"""The public API surface of the torch under test, found by introspection (never typed by hand).

[Note: what an entry is]
Every entry has an id and a kind:

* ``name``: a public name of ``torch.distributed.fsdp`` (its ``__all__`` and its other public,
  non-module attributes), of ``torch.distributed.fsdp.wrap`` (``__all__``) or of
  ``torch.distributed.checkpoint.state_dict`` (``__all__``): ``fsdp.fully_shard``,
  ``fsdp.wrap.ModuleWrapPolicy``, ``dsd.get_model_state_dict``;
* ``keyword``: an optional parameter of a callable that is a knob: the keywords of
  ``fully_shard`` and ``FullyShardedDataParallel`` (``fsdp.fully_shard(reshard_after_forward=)``,
  ``fsdp.FullyShardedDataParallel(sharding_strategy=)``), of the wrap policies (for a policy
  function: every parameter after the ``(module, recurse, nonwrapped_numel)`` FSDP passes it) and
  of the state-dict helpers (``dsd.set_state_dict(options=)``);
* ``method``: a public method, static method, class method or property a public class defines
  itself (``fsdp.FSDPModule.set_requires_all_reduce``, ``fsdp.FullyShardedDataParallel.
  optim_state_dict``, ``fsdp.UnshardHandle.wait``);
* ``member``: a public enum value (``fsdp.ShardingStrategy.HYBRID_SHARD``);
* ``field``: a public field of a config dataclass (``fsdp.MixedPrecision.reduce_dtype``,
  ``dsd.StateDictOptions.broadcast_from_rank0``), inherited fields included.

:func:`entries` lists them; :func:`tracked` maps the code objects the tracer watches to the
entries a call of them stands for (see :mod:`conformance.apisurface.trace`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import types
from dataclasses import dataclass, field

# prefix -> module; the order is the order of the map
MODULES = {
    "fsdp": "torch.distributed.fsdp",
    "fsdp.wrap": "torch.distributed.fsdp.wrap",
    "dsd": "torch.distributed.checkpoint.state_dict",
}
# callables whose keywords are entries, besides the wrap policies and the dsd helpers
KEYWORD_CALLABLES = ("fsdp.fully_shard", "fsdp.FullyShardedDataParallel")
# what FSDP1's auto-wrap passes a policy function positionally: not knobs
POLICY_PARAMS = ("module", "recurse", "nonwrapped_numel")


@dataclass(frozen=True)
class Entry:
    id: str
    kind: str  # name | keyword | method | member | field
    parent: str = ""  # the entry this one belongs to ("" for a name)
    default: str = ""  # repr of a keyword's / field's default ("" if none)


@dataclass
class Surface:
    torch_version: str
    entries: list[Entry] = field(default_factory=list)

    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def by_id(self) -> dict[str, Entry]:
        return {e.id: e for e in self.entries}


def _public_names(module: types.ModuleType, prefix: str) -> list[str]:
    names = list(getattr(module, "__all__", []))
    if prefix == "fsdp":  # public attributes outside __all__ too (submodules are not names)
        names += [
            n
            for n in sorted(vars(module))
            if not n.startswith("_")
            and n not in names
            and not isinstance(vars(module)[n], types.ModuleType)
        ]
    return names


def _is_enum(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, enum.Enum)


def _is_config(obj) -> bool:
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


def _default_repr(value) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return ""
    return repr(value)[:80]


def field_default(f: dataclasses.Field):
    """A dataclass field's default (its factory called), or ``dataclasses.MISSING``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def knob_parameters(obj, policy: bool = False) -> list[inspect.Parameter]:
    """The parameters of ``obj`` (a function, or a class's ``__init__``) that are knobs: those
    with a default and the keyword-only ones; for a wrap policy function every parameter after
    :data:`POLICY_PARAMS`."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return []
    out = []
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
            continue
        if policy and [q.name for q in params[: len(POLICY_PARAMS)]] == list(POLICY_PARAMS):
            if i >= len(POLICY_PARAMS):
                out.append(p)
        elif p.default is not p.empty or p.kind == p.KEYWORD_ONLY:
            out.append(p)
    return out


def keyword_parameters(nid: str, obj) -> list[inspect.Parameter]:
    """The knob parameters of name entry ``nid`` whose keywords are entries (none for others)."""
    if _is_enum(obj) or _is_config(obj) or not callable(obj):
        return []
    if nid in KEYWORD_CALLABLES or nid.startswith("dsd."):
        return knob_parameters(obj)
    if nid.startswith("fsdp.wrap."):
        return knob_parameters(obj, policy=not isinstance(obj, type))
    return []


def class_members(cls: type) -> list[tuple[str, object]]:
    """The public methods / static methods / class methods / properties ``cls`` defines itself."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod, property, types.FunctionType)):
            out.append((name, value))
    return out


def public_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def resolve(name_id: str):
    """The object a ``name`` entry id stands for (``fsdp.wrap.ModuleWrapPolicy`` -> the class)."""
    for prefix in sorted(MODULES, key=len, reverse=True):
        if name_id.startswith(prefix + "."):
            return getattr(importlib.import_module(MODULES[prefix]), name_id[len(prefix) + 1 :])
    raise KeyError(name_id)


def entries() -> Surface:
    """Every entry of the torch imported here, in a stable order (see [Note: what an entry is])."""
    import torch

    surface = Surface(torch.__version__)
    add = surface.entries.append
    for prefix, module_name in MODULES.items():
        module = importlib.import_module(module_name)
        for name in _public_names(module, prefix):
            obj = getattr(module, name)
            nid = f"{prefix}.{name}"
            add(Entry(nid, "name"))
            for p in keyword_parameters(nid, obj):
                add(Entry(f"{nid}({p.name}=)", "keyword", nid, _default_repr(p.default)))
            if _is_enum(obj):
                for member in obj.__members__:
                    if not member.startswith("_"):
                        add(Entry(f"{nid}.{member}", "member", nid))
            elif _is_config(obj):
                for f in public_fields(obj):
                    add(Entry(f"{nid}.{f.name}", "field", nid, _default_repr(field_default(f))))
            elif isinstance(obj, type) and name in getattr(module, "__all__", ()):
                for member, _ in class_members(obj):
                    add(Entry(f"{nid}.{member}", "method", nid))
    return surface


# ------------------------------------------------------------------------- what the tracer watches
@dataclass
class Target:
    """One watched code object: a call of it is a call of entry ``id``; ``params`` are the
    keyword entries of that call (parameter name -> (entry id, default)); ``config`` is the class
    whose construction this is (its fields are entries), if any."""

    id: str
    params: dict[str, tuple[str, object]] = field(default_factory=dict)
    config: type | None = None


def _innermost(fn):
    fn = getattr(fn, "__func__", fn)
    fn = inspect.unwrap(fn)
    return getattr(fn, "__code__", None)


def tracked(surface: Surface | None = None):
    """``(targets, enums, objects)``: ``targets`` maps ``id(code)`` of every watched function to
    its :class:`Target` s; ``enums`` maps each public enum class to its name entry; ``objects``
    maps ``id(obj)`` of every public callable (function or class) to its name entry, so that one
    passed as an argument (a policy, a ``functools.partial`` of one) is recognised."""
    surface = surface or entries()
    targets: dict[int, list[Target]] = {}
    enums: dict[type, str] = {}
    objects: dict[int, tuple[str, object]] = {}

    def watch(code, target: Target) -> None:
        if code is not None:
            targets.setdefault(id(code), []).append(target)

    def keyword_map(nid: str, obj) -> dict[str, tuple[str, object]]:
        return {p.name: (f"{nid}({p.name}=)", p.default) for p in keyword_parameters(nid, obj)}

    for e in surface.entries:
        if e.kind == "name":
            obj = resolve(e.id)
            objects[id(obj)] = (e.id, obj)
            if _is_enum(obj):
                enums[obj] = e.id
            elif isinstance(obj, type):
                init = vars(obj).get("__init__")
                if init is not None or _is_config(obj):
                    init = init or obj.__init__
                    watch(
                        _innermost(init),
                        Target(
                            e.id,
                            keyword_map(e.id, obj),
                            obj if _is_config(obj) else None,
                        ),
                    )
            elif callable(obj):
                watch(_innermost(obj), Target(e.id, keyword_map(e.id, obj)))
        elif e.kind == "method":
            cls = resolve(e.parent)
            value = vars(cls)[e.id.rsplit(".", 1)[1]]
            if isinstance(value, property):
                for accessor in (value.fget, value.fset, value.fdel):
                    if accessor is not None:
                        watch(_innermost(accessor), Target(e.id))
            else:
                watch(_innermost(value), Target(e.id))
    return targets, enums, objects
