"""Which reference lines each conformance case executes: the campaign's check selection.

[Note: the coverage map]
The campaign runs, for each mutant, only the cases that execute the mutated statement. That
mapping is measured, never written by hand: one conformance run of the unmutated tree (the
*trace run*) with the implementations loaded through :func:`reference` / :func:`reference_fsdp1`
below and ``$FSDP_MUTATION_TRACE_DIR`` set. Those factories return the built-in adapters unchanged
(same name, same expectations, same case ids) except for ``patched``, the context manager the
runner enters around every check on every rank: here it installs a line tracer
(``sys.settrace`` plus ``threading.settrace``) that records each ``reference/`` line the check
executes, and writes them on exit to one file per rank and check. The driver-side pytest plugin
(this module, loaded with ``-p``) moves the files written during each case into that case's entry,
so the map is case id -> {file: [lines]}. It also records each case's outcome and duration in the
same run (the baseline the mutants are judged against).

The map is cached under the campaign's work directory keyed by a hash of every ``.py`` file of
``reference/`` and ``conformance/`` plus the world sizes; a change to either tree makes it stale and
the next campaign traces again.

In a mutant's run the same factories, given ``$FSDP_MUTATION_IMPORT`` (the mutated module), import
that module while the adapter loads: a mutant that cannot be imported stops the run at start with
the harness's load error (exit code 2), which the campaign counts as incompetent, never as killed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
from pathlib import Path

TRACE_ENV = "FSDP_MUTATION_TRACE_DIR"
IMPORT_ENV = "FSDP_MUTATION_IMPORT"


def _reference_root() -> str:
    import reference

    return str(Path(reference.__file__).resolve().parent) + os.sep


@contextlib.contextmanager
def _record_lines():
    """Record ``(file, line)`` of every reference line run inside the block (this rank)."""
    out_dir = os.environ.get(TRACE_ENV)
    if not out_dir:
        yield
        return
    root = _reference_root()
    base = str(Path(root).parent) + os.sep
    seen: set[tuple[str, int]] = set()

    def local(frame, event, arg):
        if event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def global_(frame, event, arg):
        if frame.f_code.co_filename.startswith(root):
            seen.add((frame.f_code.co_filename, frame.f_lineno))
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(global_)
    threading.settrace(global_)
    try:
        yield
    finally:
        sys.settrace(previous)
        threading.settrace(None)
        _record_lines.count = getattr(_record_lines, "count", 0) + 1
        by_file: dict[str, list[int]] = {}
        for filename, line in seen:
            by_file.setdefault(filename[len(base) :].replace(os.sep, "/"), []).append(line)
        path = Path(out_dir) / f"{os.getpid()}-{_record_lines.count}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(by_file))
        tmp.replace(path)  # the driver never sees a half-written file


def _wrapped(builtin: str):
    from conformance.adapters.registry import load_implementation

    module = os.environ.get(IMPORT_ENV)
    if module:
        importlib.import_module(module)  # an ImportError here is the mutant's incompetence
    impl = load_implementation(builtin)
    impl.patched = _record_lines  # the runner's per-check hook (see the module's Note)
    return impl


def reference():
    """The built-in ``reference`` adapter, traced / import-checked (see the module's Note)."""
    return _wrapped("reference")


def reference_fsdp1():
    """The built-in ``reference-fsdp1`` adapter, traced / import-checked."""
    return _wrapped("reference-fsdp1")


SPECS = {
    "reference": "conformance.mutation.coverage:reference",
    "reference-fsdp1": "conformance.mutation.coverage:reference_fsdp1",
}


# --- the driver side: a pytest plugin (``-p conformance.mutation.coverage``) -----------------


def _collect(out_dir: Path) -> dict[str, set[int]]:
    lines: dict[str, set[int]] = {}
    for path in sorted(out_dir.glob("*.json")):
        for file, numbers in json.loads(path.read_text()).items():
            lines.setdefault(file, set()).update(numbers)
        path.unlink()
    return lines


def pytest_runtest_protocol(item, nextitem):
    out_dir = os.environ.get(TRACE_ENV)
    if out_dir:
        _collect(Path(out_dir))  # anything left over belongs to no case


def pytest_runtest_logfinish(nodeid, location):
    out_dir = os.environ.get(TRACE_ENV)
    if not out_dir:
        return
    lines = _collect(Path(out_dir))
    _MAP[nodeid] = {file: sorted(numbers) for file, numbers in sorted(lines.items())}


_MAP: dict[str, dict[str, list[int]]] = {}


def pytest_sessionfinish(session, exitstatus):
    out_dir = os.environ.get(TRACE_ENV)
    if out_dir:
        (Path(out_dir) / "map.out").write_text(json.dumps(_MAP))
