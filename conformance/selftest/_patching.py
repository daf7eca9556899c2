"""Finding a seeded fault's target by name at patch time, and patching it in memory.

A target is written ``"package:Name"`` or ``"package:Name.attr.attr"``: ``Name`` is a class or
function *defined* in some module under ``package`` (found by walking the package, so a module
that moves inside it is still found); the attribute path below it names what is replaced. A
module-level function is replaced in every module of the package that bound the same object
(``from ._x import f`` makes a second binding), a class attribute on the class itself. A target
that is missing or ambiguous raises :class:`BrokenFault`: the fault is broken, which is never a
catch.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from types import ModuleType


class BrokenFault(RuntimeError):
    """A seeded fault could not be applied (its target is missing or ambiguous)."""


def modules_under(package: str) -> list[ModuleType]:
    """``package`` and every submodule of it (imported now if needed; unimportable ones skipped)."""
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + "."):
        if info.name not in sys.modules:
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - an optional submodule; the target search decides
                continue
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == package or name.startswith(package + "."))
    ]


def resolve(target: str) -> tuple[object, str, object, list[ModuleType]]:
    """``(owner, attribute, current value, binding modules)`` of ``target``.

    ``binding modules`` is non-empty only for a module-level target: every module under the
    package whose global of that name is the defined object."""
    package, _, path = target.partition(":")
    if not package or not path:
        raise BrokenFault(f"bad target {target!r}: write 'package:Name[.attr...]'")
    head, *rest = path.split(".")
    try:
        modules = modules_under(package)
    except ImportError as exc:
        raise BrokenFault(f"target {target!r}: package {package!r} not importable: {exc}") from exc
    defined = {
        id(obj): obj
        for m in modules
        if (obj := vars(m).get(head)) is not None and getattr(obj, "__module__", None) == m.__name__
    }
    if len(defined) != 1:
        where = "no module" if not defined else f"{len(defined)} different objects"
        raise BrokenFault(f"target {target!r}: {where} under {package!r} defines {head!r}")
    (obj,) = defined.values()
    if not rest:
        bindings = [m for m in modules if vars(m).get(head) is obj]
        return None, head, obj, bindings
    owner = obj
    for name in rest[:-1]:
        if not hasattr(owner, name):
            raise BrokenFault(f"target {target!r}: {owner!r} has no attribute {name!r}")
        owner = getattr(owner, name)
    attr = rest[-1]
    value = _raw_attr(owner, attr)
    if value is _MISSING:
        raise BrokenFault(f"target {target!r}: {owner!r} has no attribute {attr!r}")
    return owner, attr, value, []


_MISSING = object()


def _raw_attr(owner, attr: str):
    """The attribute as stored (a property or staticmethod object, not its result)."""
    for klass in owner.__mro__ if isinstance(owner, type) else (owner,):
        if attr in vars(klass):
            return vars(klass)[attr]
    return getattr(owner, attr, _MISSING)


@contextlib.contextmanager
def patch(target: str, make: Callable[[object], object]) -> Iterator[None]:
    """Replace ``target`` with ``make(original)`` for the duration of the block."""
    owner, attr, original, bindings = resolve(target)
    replacement = make(original)
    if owner is None:
        for module in bindings:
            setattr(module, attr, replacement)
        try:
            yield
        finally:
            for module in bindings:
                setattr(module, attr, original)
        return
    had_own = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
