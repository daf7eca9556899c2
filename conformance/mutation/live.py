"""Many mutants in one conformance run: a mutant applied by swapping one function's code.

[Note: live mutants]
Starting a conformance run costs far more than the cases a mutant needs (python and torch
imports, collection, a gloo group per world size: 20-50 s on a loaded 2-core machine, against
about 0.1 s per case). So the campaign runs a *batch* of mutants in one run, on one set of
persistent process groups, each mutant as an implementation of its own, ``mutant-<n>``:

* :class:`MutantAdapter` is the built-in adapter it mutates (``reference`` or
  ``reference-fsdp1``; for the torch target ``torch-fsdp2`` or ``torch-fsdp1``, whose module is
  found by its qualified name in the imported torch) under that name, inheriting its expectations; its ``patched`` (entered by
  the runner around every check on every rank) replaces ``__code__`` of the one function whose
  body holds the mutated line with the code compiled from cosmic-ray's mutated source, and puts
  the original back when the check ends. Objects, closures and imports elsewhere keep pointing at
  the same function object, so the swap is seen everywhere, and nothing survives the check.
  A mutant in a nested function (a closure, a hook made inside a method) is applied by swapping
  the enclosing function's code: the nested function made by the next call is the mutant's.
* [Note: closures made before the swap] A nested function whose enclosing function already ran
  before the check (a decorator's ``wrapper``, applied to methods when their class was created at
  import) would never run the mutant through the next call alone. So the swap also replaces the
  code of every function object made from the nested code holding the line that a loaded module
  of the same package reaches (its namespace, classes, ``__wrapped__`` chains; the garbage
  collector cannot be asked: the workers freeze their start-up objects), and puts theirs back
  afterwards. Closures held only elsewhere (a hook registered on a module) are made during the
  check, by the swapped enclosing function.
* Only a mutant inside a function body can be applied that way. One at module or class level, in
  a decorator or a default (run at import) is judged in a fresh run with the file rewritten
  (:func:`conformance.mutation.run.judge`; for the torch target the installed file stays as it
  is and that one module is loaded from the mutant's text instead, see
  ``overlay_site/sitecustomize.py``). So is a mutant whose swap is refused on a rank (the
  function was not found, or its free variables changed): the rank raises an error marked
  :data:`NOT_APPLIED`, which the campaign never counts as a kill.
* The batch plugin (this module, ``-p conformance.mutation.live``) keeps each mutant's cases
  together, fastest first, and skips a mutant's remaining cases once one failed (``-x`` per
  mutant).

[Note: one group per mutant]
Undoing the swap after a check does not undo what the mutant's code left behind outside itself:
a rank's process-group state, a module-level cache, a collective one rank never finished. On a
shared group the next mutant's case could then fail for its neighbour's sake (two such "kills"
were seen on 2026-12-05: a gloo connection refused inside ``new_group``, and a path that only a
neighbour's leftover state took). So the plugin closes the worker group whenever the next case
belongs to another mutant: each mutant's cases run on ranks newly forked from the forkserver,
which never ran a mutant, as in a run of its own. A group starts in 0.03-0.1 s at world sizes
1-4 here (the forkserver has torch imported), so this costs well under a second per mutant.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import types
import warnings

from conformance.adapters.base import RenamedImplementation

BATCH_ENV = "FSDP_MUTATION_BATCH"  # path of the batch file (JSON, see run.live_batch)
NOT_APPLIED = "MUTANT-NOT-APPLIED"


def _batch() -> dict:
    with open(os.environ[BATCH_ENV]) as f:
        return json.load(f)


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)  # Python 3.10: names only (see Note)


def _code_objects(code: types.CodeType, found: dict) -> None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.setdefault(_qualname(const), []).append(const)
            _code_objects(const, found)


def _reachable_functions(namespace: dict, keep) -> list[types.FunctionType]:
    """The function objects ``keep`` accepts that ``namespace`` reaches: module functions,
    methods, properties, static/class methods, through decorators' ``__wrapped__``."""
    out, seen = [], set()

    def add(obj):
        for _ in range(5):
            if isinstance(obj, types.FunctionType) and id(obj) not in seen and keep(obj):
                seen.add(id(obj))
                out.append(obj)
            try:  # a lazy or proxy object may raise on any attribute
                obj = getattr(obj, "__wrapped__", None)
            except Exception:
                return
            if obj is None:
                return

    def visit(namespace, module_name, depth):
        for value in list(namespace.values()):
            if isinstance(value, (staticmethod, classmethod)):
                add(value.__func__)
            elif isinstance(value, property):
                for f in (value.fget, value.fset, value.fdel):
                    add(f)
            elif isinstance(value, type):
                if value.__module__ == module_name and depth < 4:
                    visit(vars(value), module_name, depth + 1)
            else:
                add(value)

    visit(namespace, namespace.get("__name__"), 0)
    return out


def _live_functions(module) -> list[types.FunctionType]:
    """The function objects defined in ``module``'s file that its namespace reaches."""
    return _reachable_functions(vars(module), lambda f: f.__code__.co_filename == module.__file__)


def plan_swap(module, mutated_source: str, line: int) -> list[tuple[types.FunctionType, object]]:
    """``(function, mutated code)`` for the function(s) of ``module`` whose body holds ``line``
    (the innermost, when one function's range holds another's). Raises ``RuntimeError``
    (marked :data:`NOT_APPLIED`) when the mutant cannot be applied by a swap."""
    new_codes: dict[str, list] = {}
    _code_objects(compile(mutated_source, module.__file__, "exec"), new_codes)
    for codes in new_codes.values():
        codes.sort(key=lambda c: c.co_firstlineno)
    functions = _live_functions(module)
    holders = []
    for fn in functions:
        if (span := _span(fn.__code__, line)) is not None:
            holders.append((span, fn))
    if not holders:
        raise RuntimeError(f"{NOT_APPLIED}: no function of {module.__name__} holds line {line}")
    _, target = min(holders, key=lambda h: h[0])
    same_name = sorted(
        (f for f in functions if _qualname(f.__code__) == _qualname(target.__code__)),
        key=lambda f: f.__code__.co_firstlineno,
    )
    candidates = new_codes.get(_qualname(target.__code__), [])
    if len(candidates) != len(same_name):
        raise RuntimeError(f"{NOT_APPLIED}: {target.__qualname__} not found in the mutant")
    code = candidates[same_name.index(target)]
    if code.co_freevars != target.__code__.co_freevars:
        raise RuntimeError(f"{NOT_APPLIED}: {target.__qualname__}'s free variables changed")
    return [(target, code), *_made_closures(module.__name__, target.__code__, code, line)]


def _span(code: types.CodeType, line: int) -> int | None:
    """How many lines ``code`` spans, if its range (first line to last) holds ``line``."""
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    if lines and code.co_firstlineno <= line <= max(lines):
        return max(lines) - code.co_firstlineno
    return None


def _innermost(code: types.CodeType, line: int) -> list[types.CodeType]:
    """The chain of code objects nested in ``code`` whose lines hold ``line``, outermost first."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and _span(const, line) is not None:
            return [const, *_innermost(const, line)]
    return []


def _made_closures(module_name: str, old: types.CodeType, new: types.CodeType, line: int) -> list:
    """``(function, mutated code)`` for every live function made from the nested code that holds
    ``line`` before the swap (see [Note: closures made before the swap])."""
    old_chain, new_chain = _innermost(old, line), _innermost(new, line)
    if not old_chain or len(old_chain) != len(new_chain):
        return []
    inner, mutated = old_chain[-1], new_chain[-1]
    package = module_name.partition(".")[0] + "."
    with warnings.catch_warnings():  # deprecated module attributes warn when touched
        warnings.simplefilter("ignore")
        made = {  # by identity: one function may be reachable from several modules
            id(f): f
            for name, mod in list(sys.modules.items())
            if name.startswith(package) and isinstance(getattr(mod, "__dict__", None), dict)
            for f in _reachable_functions(mod.__dict__, lambda f: f.__code__ is inner)
        }.values()
    if made and (
        _qualname(inner) != _qualname(mutated) or inner.co_freevars != mutated.co_freevars
    ):
        raise RuntimeError(f"{NOT_APPLIED}: nested {_qualname(inner)} changed shape in the mutant")
    return [(f, mutated) for f in made]


class MutantAdapter(RenamedImplementation):
    """The mutated built-in's adapter, renamed, with the mutant swapped in around each check."""

    def __init__(self, name: str, entry: dict):
        self.entry = entry
        super().__init__(entry["impl"], name, entry["id"])
        self._plan = None

    @property
    def version(self) -> str:
        return f"{self.inner.version}, mutant {self.entry['id']}"

    @contextlib.contextmanager
    def patched(self):
        if self._plan is None:
            module = importlib.import_module(self.entry["module"])
            self._plan = plan_swap(module, self.entry["source"], self.entry["line"])
        originals = [fn.__code__ for fn, _ in self._plan]
        try:
            for fn, code in self._plan:
                fn.__code__ = code
            yield
        finally:
            for (fn, _), code in zip(self._plan, originals):
                fn.__code__ = code


def __getattr__(name: str):
    """``m<n>``: a zero-argument factory of the batch's adapter ``n`` (for ``--impl``)."""
    if re.fullmatch(r"m\d+", name):

        def factory():
            entry = _batch()["adapters"][name]
            return MutantAdapter(f"mutant-{name[1:]}", entry)

        return factory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the driver side: the batch plugin (``-p conformance.mutation.live``) ---------------------

_IMPL = re.compile(r"\[mutant-(\d+)-ws(\d+)")
_killed: set[str] = set()


def _wanted() -> dict[str, int]:
    return {nodeid: i for i, nodeid in enumerate(_batch()["order"])}


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get(BATCH_ENV):
        return
    wanted = _wanted()
    keep = [it for it in items if it.nodeid in wanted]
    dropped = [it for it in items if it.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # world size first (one group spawn each), then the batch's order: mutant by mutant
    keep.sort(key=lambda it: (int(_IMPL.search(it.nodeid).group(2)), wanted[it.nodeid]))
    items[:] = keep


def _mutant_of(nodeid: str) -> str | None:
    m = _IMPL.search(nodeid)
    if m is None or not os.environ.get(BATCH_ENV):
        return None
    if not hasattr(_mutant_of, "ids"):
        _mutant_of.ids = {k: v["id"] for k, v in _batch()["adapters"].items()}
    return _mutant_of.ids.get(f"m{m.group(1)}")


_current: list[str | None] = [None]  # the mutant whose cases the worker group last ran


def pytest_runtest_setup(item):
    mutant = _mutant_of(item.nodeid)
    if mutant is None:
        return
    if mutant in _killed:
        import pytest

        pytest.skip(f"mutant {mutant} is already killed")
    if _current[0] not in (None, mutant):
        fresh_group(item.config)
    _current[0] = mutant


def fresh_group(config) -> None:
    """Close the worker group, so that the next mutant's cases run on ranks newly forked from
    the forkserver (see [Note: one group per mutant])."""
    from conformance import plugin

    plugin.session_of(config).close_group()


def pytest_runtest_logreport(report):
    mutant = _mutant_of(report.nodeid)
    if mutant is not None and report.failed:
        _killed.add(mutant)
