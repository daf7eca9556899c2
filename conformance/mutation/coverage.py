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

For the torch target (``--target torch``) the trace run loads ``torch-fsdp2`` and ``torch-fsdp1``
through :func:`torch_fsdp2` / :func:`torch_fsdp1` and records the lines of the torch target's
files as the ranks import them (``torch/distributed/fsdp/**``, ``.../checkpoint/state_dict.py``),
named relative to the directory torch is installed in (``torch/distributed/...``).

In a mutant's run the same factories, given ``$FSDP_MUTATION_IMPORT`` (the mutated module), import
that module while the adapter loads: a mutant that cannot be imported stops the run at start with
the harness's load error (exit code 2), which the campaign counts as incompetent, never as killed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import sys
import threading
from pathlib import Path

TRACE_ENV = "FSDP_MUTATION_TRACE_DIR"
IMPORT_ENV = "FSDP_MUTATION_IMPORT"


def _reference_roots() -> tuple[tuple[str, ...], str]:
    """The traced path prefixes and the base their file names are relative to."""
    import reference

    root = str(Path(reference.__file__).resolve().parent) + os.sep
    return (root,), str(Path(root).parent) + os.sep


def _torch_roots() -> tuple[tuple[str, ...], str]:
    import torch

    base = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep  # as torch was imported
    dist = os.path.join(base, "torch", "distributed")
    fsdp = os.path.join(dist, "fsdp") + os.sep
    return (fsdp, os.path.join(dist, "checkpoint", "state_dict.py")), base


@contextlib.contextmanager
def _record_lines(roots=_reference_roots):
    """Record ``(file, line)`` of every line of the target's files run inside the block (this
    rank); ``roots()`` gives the path prefixes and their base."""
    out_dir = os.environ.get(TRACE_ENV)
    if not out_dir:
        yield
        return
    root, base = roots()
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


def _wrapped(builtin: str, roots=_reference_roots):
    from conformance.adapters.registry import load_implementation

    module = os.environ.get(IMPORT_ENV)
    if module:
        importlib.import_module(module)  # an ImportError here is the mutant's incompetence
    impl = load_implementation(builtin)
    # the runner's per-check hook (see the module's Note)
    impl.patched = functools.partial(_record_lines, roots)
    return impl


def reference():
    """The built-in ``reference`` adapter, traced / import-checked (see the module's Note)."""
    return _wrapped("reference")


def reference_fsdp1():
    """The built-in ``reference-fsdp1`` adapter, traced / import-checked."""
    return _wrapped("reference-fsdp1")


def torch_fsdp2():
    """The built-in ``torch-fsdp2`` adapter, tracing the torch target's files."""
    return _wrapped("torch-fsdp2", _torch_roots)


def torch_fsdp1():
    """The built-in ``torch-fsdp1`` adapter, tracing the torch target's files."""
    return _wrapped("torch-fsdp1", _torch_roots)


SPECS = {
    "reference": "conformance.mutation.coverage:reference",
    "reference-fsdp1": "conformance.mutation.coverage:reference_fsdp1",
}
TORCH_SPECS = {
    "torch-fsdp2": "conformance.mutation.coverage:torch_fsdp2",
    "torch-fsdp1": "conformance.mutation.coverage:torch_fsdp1",
}


def specs(target: str = "reference") -> dict[str, str]:
    """implementation name -> the traced factory's spec, for the campaign's ``--target``."""
    return TORCH_SPECS if target == "torch" else SPECS


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
