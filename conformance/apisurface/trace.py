"""Which API entries each conformance case calls or passes: a traced run of the upstream adapters.

[Note: the API trace]
The mechanism is the mutation campaign's (:mod:`conformance.mutation.coverage`): the run loads
the upstream adapters through :func:`torch_fsdp2` / :func:`torch_fsdp1` below, which return the
built-in adapters unchanged (same names, expectations and case ids) except for ``patched``, the
context manager the runner enters around every check on every rank; with
``$FSDP_MUTATION_TRACE_DIR`` set it records, and the driver-side plugin of that module
(``-p conformance.mutation.coverage``) moves what each rank wrote during a case into that case's
entry of ``map.out``. Here the record is entry id -> the values seen, not lines.

What is recorded, on every rank, while the check runs (``sys.setprofile``, on the check's thread
and any thread it starts):

* a call of a watched code object (:func:`conformance.apisurface.surface.tracked`: the public
  functions, the methods, static methods and property accessors of the public classes, the
  ``__init__`` of the public classes) made from *outside* torch: the first caller frame that is
  not a wrapper (the standard library, other installed packages, torch's decorator and
  ``nn.Module.__call__`` frames) is not torch's own code. A call torch makes internally (FSDP1's
  auto-wrap building the children, a context manager calling its setter) is not the check's;
* each keyword entry of that call whose parameter holds a value other than its default;
* each field of a config class being constructed that holds a value other than its default;
* in the call's arguments (top level, one level into lists, tuples, sets and dict values, and a
  ``functools.partial`` 's function and keywords): the public enum members passed, the public
  functions and classes passed (a policy), and the non-default fields of config instances passed
  (one built at import time counts where it is used).

Only cases that pass (or fail as an expectation entry documents) count as covering: a skipped or
not-supported case asserted nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from conformance.mutation import coverage

TRACE_ENV = coverage.TRACE_ENV  # the same directory and driver plugin as the mutation trace
ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout
IMPLS = ("torch-fsdp2", "torch-fsdp1")
SPECS = {
    "torch-fsdp2": "conformance.apisurface.trace:torch_fsdp2",
    "torch-fsdp1": "conformance.apisurface.trace:torch_fsdp1",
}
DEFAULT_WS = (1, 2, 4)
COVERING = ("pass", "xfail")  # outcomes of a case that asserted something


# --- the rank side ----------------------------------------------------------------------------
class _Watch:
    """What this process watches (built once: the introspection imports torch's modules)."""

    def __init__(self):
        import torch

        from conformance.apisurface import surface

        self.targets, self.enums, self.objects = surface.tracked()
        self.torch_root = str(Path(torch.__file__).resolve().parent) + os.sep
        paths = sysconfig.get_paths()
        libs = {paths["stdlib"], paths["purelib"], paths["platlib"], paths["platstdlib"]}
        self.libs = tuple(str(Path(p).resolve()) + os.sep for p in libs if p)
        self.torch_wrappers = tuple(
            self.torch_root + p
            for p in (
                "utils/_contextlib.py",  # torch.no_grad() & co as decorators
                "_compile.py",  # torch._disable_dynamo
                "_dynamo/eval_frame.py",
                "distributed/_composable/contract.py",  # fully_shard's @contract
                "_utils_internal.py",
                # FSDP2's @_dynamo_disable (reset_iter_state); the file holds helpers only
                "distributed/fsdp/_fully_shard/_fsdp_common.py",
            )
        )
        self.module_py = self.torch_root + "nn/modules/module.py"
        self._files: dict[str, str] = {}

    def _where(self, filename: str) -> str:
        """'wrapper', 'torch' or 'user' for a code object's file (cached)."""
        where = self._files.get(filename)
        if where is None:
            resolved = filename if filename.startswith("<") else os.path.realpath(filename)
            if resolved.startswith(self.torch_wrappers):
                where = "wrapper"
            elif resolved.startswith(self.torch_root):
                where = "module" if resolved == self.module_py else "torch"
            elif resolved.startswith("<") or resolved.startswith(self.libs):
                where = "wrapper"
            else:
                where = "user"
            self._files[filename] = where
        return where

    def external(self, frame) -> bool:
        """Whether the call that made ``frame`` came from outside torch (see the module Note)."""
        caller = frame.f_back
        while caller is not None:
            code = caller.f_code
            where = self._where(code.co_filename)
            if where == "module":
                where = "wrapper" if code.co_name in _CALL_FRAMES else "torch"
            if where == "torch":
                return False
            if where == "user":
                return True
            caller = caller.f_back
        return True


_WATCH: list[_Watch] = []
# nn.Module.__call__'s frames: a module called by the check runs its forward for the check
_CALL_FRAMES = ("_call_impl", "_wrapped_call_impl", "inner")


def _short(value) -> str:
    """A short label of a value passed (never the repr of a tensor or a module)."""
    import torch

    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)[:40]
    return type(value).__name__[:40]


def _same(value, default) -> bool:
    if value is default:
        return True
    if default is None or isinstance(value, (list, dict, set, tuple)):
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the default
        return False


class _Recorder:
    def __init__(self, watch: _Watch):
        self.watch = watch
        self.seen: dict[str, set[str]] = {}

    def note(self, entry: str, value: str = "") -> None:
        values = self.seen.setdefault(entry, set())
        if value and len(values) < 8:
            values.add(value)

    def config_fields(self, nid: str, cls: type, values: dict) -> None:
        from conformance.apisurface.surface import field_default, public_fields

        for f in public_fields(cls):
            if f.name in values and not _same(values[f.name], field_default(f)):
                self.note(f"{nid}.{f.name}", _short(values[f.name]))

    def scan(self, value, depth: int = 0) -> None:
        watch = self.watch
        kind = type(value)
        if kind in watch.enums:
            if not value.name.startswith("_"):  # a private member is no entry
                self.note(f"{watch.enums[kind]}.{value.name}")
            return
        known = watch.objects.get(id(value))
        if known is not None and known[1] is value:
            self.note(known[0])
            return
        known = watch.objects.get(id(kind))
        if known is not None and known[1] is kind and dataclasses.is_dataclass(kind):
            self.note(known[0])
            self.config_fields(
                known[0], kind, {f.name: getattr(value, f.name) for f in dataclasses.fields(kind)}
            )
            return
        if isinstance(value, functools.partial):
            self.scan(value.func, depth)
            known = watch.objects.get(id(value.func))
            if known is not None:
                from conformance.apisurface.surface import _innermost

                for target in watch.targets.get(id(_innermost(value.func)), ()):
                    for name, given in value.keywords.items():
                        if name in target.params and not _same(given, target.params[name][1]):
                            self.note(target.params[name][0], _short(given))
            for item in (*value.args, *value.keywords.values()):
                self.scan(item, depth + 1)
            return
        if depth < 1 and kind in (list, tuple, set, frozenset):
            for item in list(value)[:64]:
                self.scan(item, depth + 1)
        elif depth < 1 and kind is dict:
            for item in list(value.values())[:64]:
                self.scan(item, depth + 1)

    def call(self, frame, targets) -> None:
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
        local = frame.f_locals
        args = {name: local[name] for name in code.co_varnames[:n] if name in local}
        defaulted = set()  # parameters holding their default: nothing was passed to scan
        for target in targets:
            self.note(target.id)
            for name, (kid, default) in target.params.items():
                if name not in args:
                    continue
                if _same(args[name], default):
                    defaulted.add(name)
                else:
                    self.note(kid, _short(args[name]))
            if target.config is not None:
                self.config_fields(target.id, target.config, args)
        for name, value in args.items():
            if name == "self" or name in defaulted:
                continue
            if (
                code.co_flags & 0x04
                and name == code.co_varnames[n - 1 - bool(code.co_flags & 0x08)]
            ):
                for item in value:
                    self.scan(item)
            elif code.co_flags & 0x08 and name == code.co_varnames[n - 1]:
                for item in value.values():
                    self.scan(item)
            else:
                self.scan(value)


_COUNT = [0]
ERRORS = "!errors"  # the recorder's own failures, by entry (never an entry; see run_trace)


@contextlib.contextmanager
def _record_api():
    """Record the entries the block calls or passes (this rank; see the module's Note)."""
    out_dir = os.environ.get(TRACE_ENV)
    if not out_dir:
        yield
        return
    if not _WATCH:
        _WATCH.append(_Watch())
    watch = _WATCH[0]
    recorder = _Recorder(watch)
    targets = watch.targets

    def profile(frame, event, arg):
        if event == "call":
            found = targets.get(id(frame.f_code))
            if found is not None:
                try:
                    if watch.external(frame):
                        recorder.call(frame, found)
                except Exception as exc:  # noqa: BLE001 - never break the check being traced
                    recorder.note(ERRORS, f"{found[0].id}: {type(exc).__name__}: {exc}"[:120])

    previous = sys.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
        _COUNT[0] += 1
        data = {entry: sorted(values) for entry, values in recorder.seen.items()}
        path = Path(out_dir) / f"{os.getpid()}-api{_COUNT[0]}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)  # the driver never sees a half-written file


def _wrapped(builtin: str):
    from conformance.adapters.registry import load_implementation

    impl = load_implementation(builtin)
    impl.patched = _record_api  # the runner's per-check hook (see the module's Note)
    return impl


def torch_fsdp2():
    """The built-in ``torch-fsdp2`` adapter, its checks traced (see the module's Note)."""
    return _wrapped("torch-fsdp2")


def torch_fsdp1():
    """The built-in ``torch-fsdp1`` adapter, its checks traced."""
    return _wrapped("torch-fsdp1")


# --- the driver side --------------------------------------------------------------------------
def tree_key(ws, root: Path = ROOT) -> str:
    """The cache key of a trace: every file of ``conformance/`` (checks, adapters, expectations;
    not this package's snapshot), the torch version and the world sizes."""
    import torch

    h = hashlib.sha256(f"torch {torch.__version__} ws {list(ws)}\0".encode())
    for path in sorted((root / "conformance").rglob("*")):
        if (
            not path.is_file()
            or "__pycache__" in path.parts
            or path.suffix == ".pyc"
            or path.parent.name == "apisurface"
            and path.suffix != ".py"
        ):
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fsdp-conformance"


def run_trace(
    ws=DEFAULT_WS,
    extra: list[str] | None = None,
    timeout: float = 3600,
    quiet: bool = False,
) -> dict:
    """One traced run of the upstream adapters; returns ``{"cases": {case: {...}}, "wall_s"}``,
    each case with its id, check, impl, outcome and the ``entries`` it recorded (entry -> values).
    ``extra`` are more arguments for the run (``-k``, ``--check-dir``, a check file)."""
    work = Path(tempfile.mkdtemp(prefix="api-trace-"))
    trace_dir = work / "trace"
    trace_dir.mkdir()
    reports = work / "reports"
    cmd = [
        sys.executable,
        "-m",
        "conformance",
        "--impl",
        ",".join(SPECS.values()),
        "--world-sizes",
        ",".join(map(str, ws)),
        "-p",
        "conformance.mutation.coverage",
        "-p",
        "no:cacheprovider",
        "--reports-dir",
        str(reports),
        "-q",
        "--tb=no",
        *(extra or []),
    ]
    env = dict(os.environ, **{TRACE_ENV: str(trace_dir)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if not quiet:
        print(f"api-coverage: one traced run at ws {list(ws)} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        wall = round(time.monotonic() - started, 1)
        if proc.returncode not in (0, 1) or not (trace_dir / "map.out").exists():
            raise SystemExit(
                f"api-coverage: the traced run exited {proc.returncode}:\n"
                f"{(proc.stdout + proc.stderr)[-3000:]}"
            )
        recorded = json.loads((trace_dir / "map.out").read_text())
        report = json.loads((reports / "conformance.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    errors = sorted({v for e in recorded.values() for v in e.get(ERRORS, [])})
    if errors and not quiet:
        print(f"api-coverage: the recorder failed on {errors}", file=sys.stderr, flush=True)
    cases = {}
    for case in report["cases"]:
        cases[case["nodeid"]] = {
            "id": case["id"],
            "check": case["check"],
            "impl": case["impl"],
            "outcome": case["outcome"],
            "entries": {e: v for e, v in recorded.get(case["nodeid"], {}).items() if e != ERRORS},
        }
    return {
        "cases": cases,
        "wall_s": wall,
        "ws": list(ws),
        "returncode": proc.returncode,
        "recorder_errors": errors,
    }


def wide_selection(base: dict, ws: int) -> list[str]:
    """The built-in checks to trace again at world size ``ws`` (> 2), as node ids
    (``conformance/checks/x.py::name``): those that can run there and either had no covering
    case in ``base`` (the trace at world sizes 1 and 2: a check written for 4 ranks) or need a
    2-D mesh (``hsdp``: a mesh of 2 x 2 takes another path)."""
    import inspect

    from conformance import spec
    from conformance.adapters import base as capabilities
    from conformance.registry import CHECKS

    spec.load_checks()
    covered = {c["id"].split("[", 1)[0] for c in base["cases"].values() if c["outcome"] in COVERING}
    targets = set()
    for check in CHECKS:
        runs = (check.world_sizes is None or ws in check.world_sizes) and ws >= check.min_world_size
        if runs and (
            f"{check.area}::{check.name}" not in covered or capabilities.HSDP in check.requires
        ):
            path = Path(inspect.getsourcefile(inspect.unwrap(check.fn))).resolve()
            targets.add(f"{path.relative_to(ROOT).as_posix()}::{check.name}")
    return sorted(targets)


def full_trace(ws=DEFAULT_WS) -> dict:
    """The trace of the whole suite: every check at the world sizes <= 2 of ``ws``, then at each
    larger one the checks :func:`wide_selection` picks (the cost of a full run at 4 ranks buys
    little: most checks call the same entries at every world size)."""
    small = [w for w in ws if w <= 2]
    data = run_trace(small) if small else {"cases": {}, "wall_s": 0.0}
    for wide in (w for w in ws if w > 2):
        targets = wide_selection(data, wide)
        if targets:
            more = run_trace([wide], extra=targets)
            data["cases"].update(more["cases"])
            data["wall_s"] = round(data["wall_s"] + more["wall_s"], 1)
            data["recorder_errors"] = sorted(
                {*data.get("recorder_errors", []), *more["recorder_errors"]}
            )
    data["ws"] = list(ws)
    return data


def cached_trace(ws=DEFAULT_WS, refresh: bool = False) -> dict:
    """:func:`full_trace`, cached under :func:`cache_dir` by :func:`tree_key`."""
    import torch

    key = tree_key(ws)
    path = cache_dir() / f"api-trace-{key}.json"
    if path.exists() and not refresh:
        return json.loads(path.read_text())
    data = full_trace(ws) | {"key": key, "torch": torch.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data
