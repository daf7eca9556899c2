"""The pytest plugin that turns registered checks into cases and runs them on worker groups.

Activated with ``-p conformance.plugin`` (``nox -s conformance`` and ``python -m conformance`` do it).
Options are listed under "fsdp conformance" in ``pytest --help``.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance import devices, expectations, options, reporting, versions
from conformance.adapters import base
from conformance.adapters.registry import (
    ENV_VAR,
    ImplementationLoadError,
    default_specs,
    load_implementation,
)
from conformance.registry import CHECKS, CheckSpec, case_id
from conformance.runner import protocol
from conformance.runner.protocol import Task

CHECKS_DIR = Path(__file__).parent / "checks"
TORCHRUN = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
# Under torchrun a hung rank's stack goes to the real stderr, kept here before pytest's capture
# (which starts after plugins given with -p are imported) takes fd 2 over.
_TERMINAL_FD = os.dup(2) if TORCHRUN else 2


def pytest_addoption(parser):
    g = parser.getgroup("fsdp conformance")
    g.addoption(
        "--impl",
        default=None,
        help="comma-separated implementations: built-in names (torch-fsdp2, torch-fsdp1, "
        "reference, reference-fsdp1), entry-point names or package.module:attr "
        "(default: $FSDP_CONFORMANCE_IMPL, else every built-in)",
    )
    g.addoption(
        "--world-sizes",
        default=None,
        help="comma-separated world sizes (default 1,2,3,4 on CPU; 1,2,4,8 capped at the "
        "GPU count on GPUs)",
    )
    g.addoption(
        "--device", default=None, help="device type: cpu, cuda, xpu, hpu, ... (default: auto)"
    )
    g.addoption("--backend", default=None, help="process-group backend (default: the device's)")
    g.addoption(
        "--check-timeout",
        default=options.DEFAULT_CHECK_TIMEOUT,
        help="seconds a check may run before its stacks are dumped and it fails (default 60); a "
        "check that declares a longer budget gets that multiple of it",
    )
    g.addoption(
        "--grace",
        default=5.0,
        help="seconds other ranks get to finish after one rank fails (default 5)",
    )
    g.addoption("--threads-per-rank", default=1, help="torch threads per rank (default 1)")
    g.addoption(
        "--reports-dir", default="reports", help="where the report files go (default reports/)"
    )
    g.addoption(
        "--expectations-dir",
        default=str(expectations.DEFAULT_DIR),
        help="directory of <impl>[.<device>].txt expected-failure lists",
    )
    g.addoption(
        "--respawn-every-check",
        action="store_true",
        help="spawn a fresh process group for every check (slow; for measuring the reuse win)",
    )
    g.addoption(
        "--check-dir",
        action="append",
        default=[],
        help="another directory of check modules to collect (importable from the rootdir); "
        "repeatable",
    )
    g.addoption(
        "--shuffle",
        default=None,
        metavar="SEED",
        help="run the cases of each world size in a random order drawn from SEED (a whole "
        "number); outcomes must not depend on it (see docs/running.md, 'Isolation between checks')",
    )
    g.addoption(
        "--rank-memory-limit",
        default=None,
        help="resident memory a rank may use before it is killed and fails its check, e.g. 6G, "
        "800M, or off (default: the host's MemTotal / (world size + 1))",
    )
    g.addoption(
        "--no-isolation",
        action="store_true",
        help="skip the snapshot and restore of process-global state around each check (for "
        "measuring its cost; leaks then go unreported)",
    )
    g.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        help="random examples per fuzz case (default: a fixed, derandomized CI budget)",
    )


@dataclass
class CaseMeta:
    spec: CheckSpec
    impl_spec: str
    impl_name: str
    world_size: int
    case: str
    case_id: str
    device: str
    backend: str
    nodeid: str = ""
    rerun: reporting.Rerun = reporting.Rerun()  # what else its repro command must carry


class ConformanceSession:
    """Per-run state: implementations, worker groups, case metadata, results."""

    def __init__(self, config):
        """Validate every option and load every implementation; raises :class:`UsageError`."""
        self.config = config
        opt = config.option
        self.started = time.time()
        self.torchrun = TORCHRUN
        self.is_reporter = not self.torchrun or int(os.environ.get("RANK", "0")) == 0
        self.options = options.validate(
            opt,
            config.rootpath,
            torchrun=self.torchrun,
            writes_reports=self.is_reporter and not opt.collectonly,
        )
        # validated values replace the strings for every later reader of config.option
        opt.check_timeout, opt.grace = self.options.check_timeout, self.options.grace
        opt.threads_per_rank = self.options.threads_per_rank
        self.impls = {}
        for spec in self.options.impl_specs or default_specs():
            try:
                self.impls[spec] = load_implementation(spec)
            except ImplementationLoadError as exc:
                raise options.UsageError(
                    "--impl" if self.options.impl_specs else f"${ENV_VAR}",
                    str(exc),
                    "fix the adapter or choose another implementation",
                ) from None
        names = [i.name for i in self.impls.values()]
        if len(set(names)) != len(names):
            raise options.UsageError(
                "--impl",
                f"two selected implementations share a name: {names}",
                "select one of them",
            )
        if self.torchrun:  # one world size, $WORLD_SIZE (see docs/multi-node.md)
            from conformance.runner.inprocess import launched_sizes

            self.world_sizes, self.placement = launched_sizes(
                opt.world_sizes, self.options.device, self.options.backend
            )
        else:
            self.world_sizes = self.options.world_sizes or devices.default_world_sizes(
                self.options.device
            )
            self.placement = {
                ws: devices.choose(ws, self.options.device, self.options.backend)
                for ws in self.world_sizes
            }
        self._check_impl_devices()
        try:
            self._load_expectations()
        except ValueError as exc:  # ExpectationsError, or a file that is not text
            raise options.UsageError(
                "--expectations-dir", str(exc).splitlines()[0], "fix or remove that file"
            ) from None
        self.meta: dict[str, CaseMeta] = {}
        self.records: dict[str, dict] = {}
        self.spawns: dict[int, int] = {}
        if self.options.reports_dir is not None:  # last: nothing is created for a bad run
            options.writable_dir("--reports-dir", self.options.reports_dir)
        self.run_dir: Path | None = None  # this run's reports (see reporting.start_run)
        self.rerun = reporting.rerun_options(opt, self.options, list(self.impls))
        self.selected: list[str] | None = None  # node ids of the cases to run, once collected
        self.interrupted: str | None = None  # the signal's name when the run was interrupted
        self._group = None

    def _check_impl_devices(self) -> None:
        """An adapter that declares ``devices`` (the device types it runs on) cannot run here
        when a world size was placed on another device type: one line, before anything runs."""
        for impl in self.impls.values():
            wanted = getattr(impl, "devices", None)
            wrong = {d for d, _ in self.placement.values()} - set(wanted or ())
            if wanted is not None and wrong:
                sizes = [ws for ws, (d, _) in self.placement.items() if d in wrong]
                raise options.UsageError(
                    "--device",
                    f"implementation {impl.name} runs on {', '.join(sorted(wanted))} only "
                    f"(its adapter's devices), but world size(s) {sizes} run on "
                    f"{', '.join(sorted(wrong))}",
                    f"pass --device {sorted(wanted)[0]} on a machine with enough of them (and "
                    f"--world-sizes it can hold), or run {impl.name} elsewhere",
                )

    def _load_expectations(self) -> None:
        from conformance import deviations

        opt = self.config.option
        self.expect = {}
        exp_dir = Path(opt.expectations_dir)
        for impl in self.impls.values():
            for ws in self.world_sizes:
                dev = self.placement[ws][0]
                if (impl.name, dev) not in self.expect:  # its own entries and its bases'
                    self.expect[(impl.name, dev)] = deviations.expectations_for(impl, dev, exp_dir)

    # ---------------------------------------------------------------- groups
    def group(self, world_size: int):
        if self._group is not None and self._group.world_size != world_size:
            self.close_group()
        if self._group is None:
            device, backend = self.placement[world_size]
            opt = self.config.option
            if self.torchrun:
                from conformance.runner.inprocess import InProcessGroup

                self._group = InProcessGroup(
                    device, backend, grace=opt.grace, terminal_fd=_TERMINAL_FD, session=self
                )
            else:
                from conformance.runner.pool import WorkerGroup

                self._group = WorkerGroup(
                    world_size,
                    device,
                    backend,
                    threads_per_rank=opt.threads_per_rank,
                    grace=opt.grace,
                    memory_limit=self.options.memory_limit(world_size),
                )
        return self._group

    def close_group(self):
        if self._group is not None:
            self.spawns[self._group.world_size] = self.spawns.get(
                self._group.world_size, 0
            ) + getattr(self._group, "spawn_count", 0)
            self._group.close()
            self._group = None

    def check_dirs(self) -> list[Path]:
        return [CHECKS_DIR] + [Path(d).resolve() for d in self.config.option.check_dir]

    def stale_entries(self) -> list[expectations.Entry]:
        """Entries that match no case of any registered check at any world size 1-8."""
        for directory in self.check_dirs():
            for path in sorted(directory.rglob("*.py")):
                if is_check_file(path, directory):
                    importlib.import_module(_module_name(self.config, path))
        universe = [
            case_id(s.area, s.name, ws, c) for s in CHECKS for ws in range(1, 9) for c in s.cases
        ]
        stale = []
        for exp in self.expect.values():
            for entry in exp.entries:
                if not any(entry.matches(cid) for cid in universe) and entry not in stale:
                    stale.append(entry)
        return stale


def is_check_file(path: Path, directory: Path) -> bool:
    """A check module is a ``.py`` file at any depth below a check directory, none of whose path
    parts below it starts with ``_`` (``_shared/``, ``_models.py`` and ``__init__.py`` hold
    helpers, never checks)."""
    try:
        parts = path.resolve().relative_to(directory.resolve()).parts
    except ValueError:
        return False
    return path.suffix == ".py" and not any(part.startswith("_") for part in parts)


def _module_name(config, path: Path) -> str:
    """Import name of a check file: its path relative to the rootdir, dotted."""
    try:
        parts = path.resolve().relative_to(CHECKS_DIR.resolve()).with_suffix("").parts
        return ".".join(("conformance", "checks", *parts))
    except ValueError:
        return ".".join(path.resolve().relative_to(config.rootpath).with_suffix("").parts)


_SESSION_KEY = pytest.StashKey[ConformanceSession]()


def session_of(config) -> ConformanceSession:
    """The run's session, for plugins that drive its worker groups (``conformance.mutation.live``)."""
    return config.stash[_SESSION_KEY]


_session = session_of


# [Note: exit codes] of ``python -m conformance`` (see docs/running.md, "Exit codes and signals")
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_RANKS_LOST = 6  # torchrun / srun: ranks were lost mid-run (conformance.runner.inprocess)
_outcome: dict[str, int] = {}  # "usage_error" / "signal" of the last run in this process


def exit_status(pytest_code: int) -> int:
    """The command's exit code for pytest's ``pytest_code`` (see [Note: exit codes])."""
    if _outcome.get("usage_error") or _outcome.get("reports_not_written"):
        return EXIT_USAGE
    if _outcome.get("ranks_lost"):
        return EXIT_RANKS_LOST
    if pytest_code == pytest.ExitCode.INTERRUPTED:
        return 128 + _outcome.get("signal", signal.SIGINT)
    if pytest_code == pytest.ExitCode.USAGE_ERROR:  # pytest's own options
        return EXIT_USAGE
    return int(pytest_code)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Validate the options and load the implementations before anything runs: a bad one ends
    the run here with one line on stderr and exit code 2 (no traceback, no report)."""
    _outcome.clear()
    if config.option.help or config.option.version:
        return None
    if not isinstance(sys.stdout, ClosedPipeGuard):  # before pytest's terminal writer takes it
        sys.stdout = ClosedPipeGuard(sys.stdout)
    try:
        session = ConformanceSession(config)
    except options.UsageError as exc:
        _outcome["usage_error"] = 1
        sys.stderr.write(f"fsdp conformance: {exc}\n")
        return EXIT_USAGE
    except Exception:  # a bug of the harness: say so, with the traceback
        sys.stderr.write(f"fsdp conformance: internal error\n{traceback.format_exc()}")
        return EXIT_INTERNAL
    config.stash[_SESSION_KEY] = session
    return None


def pytest_addhooks(pluginmanager):
    """A conformance run times nothing: pytest-benchmark's plugin, loaded after this one, would
    create its storage (``./.benchmarks``) in the current directory (perf/ runs without this
    plugin). Hypothesis' storage goes under the cache directory (``conformance.fuzz.item``)."""
    pluginmanager.set_blocked("benchmark")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if _SESSION_KEY not in config.stash:  # --help / --version
        return
    session = _session(config)
    if not session.is_reporter:  # under torchrun only rank 0 reports; the others print nothing
        config.option.xmlpath = None
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - read by the terminal reporter, made next
        return
    warning = options.oversubscription_warning(session.world_sizes, session.placement)
    if warning:
        sys.stderr.write(warning + "\n")
    import torch

    warning = versions.support_warning(torch.__version__)  # a torch outside the supported range
    if warning:
        sys.stderr.write(warning + "\n")
    if session.options.reports_dir is not None:  # not --collect-only
        session.run_dir, others = reporting.start_run(session.options.reports_dir)
        if others:
            sys.stderr.write(
                f"fsdp conformance: NOTE another run (pid {', '.join(map(str, others))}) is writing "
                f"into {session.options.reports_dir} too: this run's reports are in "
                f"{session.run_dir}; the top-level files will be whichever run ends last\n"
            )
        if not getattr(config.option, "xmlpath", None):
            config.option.xmlpath = str(session.run_dir / "conformance.xml")
    if not session.torchrun and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        # A run started with SIGINT ignored (a background job, nohup) keeps ignoring it, as Unix
        # programs do; SIGTERM still stops it (docs/running.md, "Exit codes and signals").
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum, frame):
    """SIGTERM ends the run like Ctrl-C: workers are killed, the reports are written. A signal
    that comes while the run is already stopping (a CI runner that signals the whole process
    group, or again before its SIGKILL) is noted and otherwise ignored: raising again would cut
    the writing of the partial reports short."""
    if "signal" in _outcome:
        return
    _outcome["signal"] = signum
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


class ClosedPipeGuard:
    """The stdout pytest's terminal writer gets: when the reader of a pipe goes away (``| head``,
    quitting ``less``) the first failed write points file descriptor 1 at ``/dev/null`` and every
    later write is dropped, so the run goes on to its end and writes its reports, quietly, with
    its own exit code (docs/running.md, "Exit codes and signals")."""

    def __init__(self, stream):
        self._stream = stream
        self.closed = False

    def write(self, text: str) -> int:
        if not self.closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.closed = True
        _outcome["closed_stdout"] = 1
        silence_stdout()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def silence_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` (what is still buffered for it goes there too)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def pytest_keyboard_interrupt(excinfo):
    _outcome.setdefault("signal", signal.SIGINT)
    from conformance.runner.pool import kill_all_groups

    kill_all_groups()  # at once: the workers may be stuck in a check


def pytest_collection_finish(session):
    if _SESSION_KEY in session.config.stash:
        cs = _session(session.config)
        cs.selected = [item.nodeid for item in session.items if item.nodeid in cs.meta]


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """An interrupted run is known before the terminal summary and the reports are written. The
    JUnit XML is written inside this hook (pytest's junitxml): a full disk there is reported like
    any other report that cannot be written (see :func:`_reports_not_written`), not as an
    internal error, and the terminal summary still follows (it runs outside this wrapper)."""
    if _SESSION_KEY in session.config.stash and exitstatus == pytest.ExitCode.INTERRUPTED:
        signum = _outcome.get("signal", signal.SIGINT)
        _session(session.config).interrupted = signal.Signals(signum).name
    try:
        return (yield)
    except OSError as exc:
        if _SESSION_KEY not in session.config.stash or not _disk_error(exc):
            raise
        directory = Path(getattr(session.config.option, "xmlpath", "") or ".").parent
        records = _session(session.config).records.values()
        needed = sum(1000 + len(r.get("message", "")) for r in records)  # XML: about this much
        _reports_not_written(reporting.ReportsNotWritten(directory, needed, exc))
        return None


def _disk_error(exc: OSError) -> bool:
    """A write that failed for want of space (a full disk, a quota, a file-size limit)."""
    import errno

    return isinstance(exc, reporting.ReportsNotWritten) or exc.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
    )


def _reports_not_written(exc: OSError) -> None:
    """One line on stderr (once) and exit code 2 (see [Note: exit codes])."""
    if not _outcome.get("reports_not_written"):
        _outcome["reports_not_written"] = 1
        sys.stderr.write(f"fsdp conformance: {exc}\n")
        sys.stderr.flush()


def pytest_unconfigure(config):
    if _SESSION_KEY in config.stash:
        session = _session(config)
        session.close_group()
        _finish_reports(session)  # when no terminal summary ran (-p no:terminal)


def _finish_reports(session, wall: float | None = None, stale=None) -> None:
    """Write this run's JSON and Markdown (when ``wall`` is given), then publish them to the
    top level (a finished run) or leave them in the run's directory (an interrupted one); once.
    A file that cannot be written ends the run with one line and exit code 2, the previous
    reports untouched (see [Note: report files] in conformance.reporting)."""
    if session.run_dir is None or getattr(session, "reports_done", False):
        return
    session.reports_done = True
    try:
        if wall is not None and not _outcome.get("reports_not_written"):
            reporting.write_files(session, wall, stale or [], session.run_dir)
        if session.interrupted or _outcome.get("reports_not_written"):
            reporting.keep_partial_run(session.run_dir)  # the top-level files stay as they are
        else:
            reporting.publish_run(session.run_dir, session.options.reports_dir)
    except OSError as exc:
        if not _disk_error(exc):
            raise
        _reports_not_written(exc)
        (session.run_dir / ".running").unlink(missing_ok=True)


def pytest_collect_file(file_path: Path, parent):
    if any(is_check_file(file_path, d) for d in _session(parent.config).check_dirs()):
        return CheckFile.from_parent(parent, path=file_path)
    return None


class CheckFile(pytest.File):
    def collect(self):
        module_name = _module_name(self.config, self.path)
        importlib.import_module(module_name)
        session = _session(self.config)
        for spec in [s for s in CHECKS if s.fn.__module__ == module_name]:
            for impl_spec, impl in session.impls.items():
                for ws in session.world_sizes:
                    if not spec.applies_to(ws):
                        continue
                    device, backend = session.placement[ws]
                    for case in spec.cases:
                        suffix = f"-{case}" if case else ""
                        item_class = getattr(spec.fn, "item_class", CheckItem)  # fuzz: FuzzItem
                        item = item_class.from_parent(
                            self, name=f"{spec.name}[{impl.name}-ws{ws}{suffix}]"
                        )
                        meta = CaseMeta(
                            spec,
                            impl_spec,
                            impl.name,
                            ws,
                            case,
                            case_id(spec.area, spec.name, ws, case),
                            device,
                            backend,
                            item.nodeid,
                            session.rerun,
                        )
                        item.meta = meta
                        session.meta[item.nodeid] = meta
                        entry = session.expect[(impl.name, device)].match(meta.case_id)
                        item.expectation = entry
                        if entry is not None:
                            entry.matched += 1
                            item.add_marker(
                                pytest.mark.xfail(
                                    reason=f"{entry.reason} [{entry.source}; {entry.signature()}]",
                                    strict=True,
                                    run=True,
                                    raises=ExpectedFailure,
                                )
                            )
                        yield item


class CheckFailure(Exception):
    """A check failed on at least one rank; ``str()`` is the per-rank report."""


class ExpectedFailure(CheckFailure):
    """A listed case failed the way its expectations entry says (the only xfail-able exception)."""


class CheckItem(pytest.Item):
    meta: CaseMeta
    expectation: expectations.Entry | None = None
    rank_results: list = ()

    def _missing_capabilities(self) -> list[str]:
        impl = _session(self.config).impls[self.meta.impl_spec]
        return sorted(self.meta.spec.requires - set(impl.capabilities))

    def _supported_implementation(self):
        """The case's implementation; a NotSupported skip when it lacks a capability the check needs."""
        impl = _session(self.config).impls[self.meta.impl_spec]
        missing = self._missing_capabilities()
        if missing:
            pytest.skip(base.not_supported_reason(impl.name, base.UNDECLARED + ", ".join(missing)))
        return impl

    def setup(self):
        # (Re)start the group here so that start-up time is not counted as the check's duration.
        if not self._missing_capabilities():
            _session(self.config).group(self.meta.world_size).start()

    def runtest(self):
        meta, session = self.meta, _session(self.config)
        impl = self._supported_implementation()
        timeout, timeout_text = check_budget(meta.spec, self.config.option.check_timeout)
        group = session.group(meta.world_size)
        task = Task(
            meta.spec.path,
            meta.impl_spec,
            meta.spec.cases[meta.case],
            timeout,
            timeout_text,
            case=meta.case_id,
            isolated=not self.config.option.no_isolation,
        )
        results = group.run(task, settled=_settled_by(self.expectation))
        self.rank_results = results
        stop = getattr(group, "stop_reason", "")  # torchrun / srun: ranks lost or stuck
        if stop:  # the run stops here; its reports are partial ("INTERRUPTED by lost ranks ...")
            session.interrupted = stop
            _outcome["ranks_lost"] = 1
            self.session.shouldfail = stop
        if self.config.option.respawn_every_check:
            session.close_group()
        passed = (protocol.OK, protocol.NOT_SUPPORTED, protocol.SKIPPED)
        failed = [r for r in results if r.status not in passed]
        if failed:
            raise _failure(self.expectation, results)
        unsupported = [r for r in results if r.status == protocol.NOT_SUPPORTED]
        if unsupported:
            pytest.skip(base.not_supported_reason(impl.name, unsupported[0].detail))
        skipped = [r for r in results if r.status == protocol.SKIPPED]
        if skipped:
            pytest.skip(f"skipped: {skipped[0].detail}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.meta.case_id} on {self.meta.impl_name}"


def _settled_by(entry):
    """For a listed case, whether one rank's result already makes it an expected failure (one
    fitting rank suffices; see [Note: a settled verdict] in :mod:`conformance.runner.pool`)."""
    if entry is None:
        return None
    return lambda result: entry.mismatch(expectations.failures([result])) is None


def _failure(entry, results) -> CheckFailure:
    """ExpectedFailure when ``entry`` lists the case and its signature fits, else CheckFailure."""
    return judged(entry, results, _format_failure(results))


def judged(entry, results, text: str) -> CheckFailure:
    """The failure ``text`` of a case judged by its expectation ``entry`` (fuzz cases too,
    ``conformance.fuzz.item``): :class:`ExpectedFailure` (reported xfail) when the entry's
    signature fits the rank results, a plain failure naming the entry and what did not match when
    it does not, a plain failure without an entry."""
    if entry is None:
        return CheckFailure(text)
    why_not = entry.mismatch(expectations.failures(results))
    if why_not is None:
        return ExpectedFailure(text)
    return CheckFailure(
        f"listed in {entry.source} as {entry.prefix} {entry.signature()}, but failed "
        f"differently: {why_not}\n{text}"
    )


def check_budget(spec: CheckSpec, check_timeout: float) -> tuple[float, str]:
    """Seconds ``spec`` may run under ``--check-timeout`` and how that came about: a check's own
    ``timeout=`` is its budget at the default check-timeout, so it scales with the option."""
    factor = (spec.timeout or options.DEFAULT_CHECK_TIMEOUT) / options.DEFAULT_CHECK_TIMEOUT
    seconds = factor * check_timeout
    if factor == 1:
        return seconds, f"{seconds:g} s (--check-timeout)"
    return seconds, f"{seconds:g} s ({factor:g} x --check-timeout {check_timeout:g})"


def _format_failure(results) -> str:
    lines = []
    for r in results:
        if r.status == protocol.OK and not r.detail:
            lines.append(f"rank {r.rank}: ok ({r.duration:.2f} s)")
            continue
        lines.append(f"rank {r.rank}: {r.status} ({r.duration:.2f} s)")
        lines.extend("    " + ln for ln in r.detail.rstrip().splitlines())
    return "\n".join(lines)


def pytest_collection_modifyitems(session, config, items):
    # run all cases of one world size together so each group is spawned once
    cs = _session(config)
    world_size = lambda it: getattr(getattr(it, "meta", None), "world_size", 0)  # noqa: E731
    if cs.options.shuffle is not None:  # each world size's cases in an order drawn from the seed
        items[:] = shuffled(items, cs.options.shuffle, world_size)
    order = {ws: i for i, ws in enumerate(cs.world_sizes)}
    items.sort(key=lambda it: order.get(world_size(it), -1))


def shuffled(items: list, seed: int, world_size) -> list:
    """``items`` with the cases of each world size in a random order drawn from ``seed`` and
    that world size's cases alone (not the other world sizes selected beside them, nor the
    order pytest collected them in). Items keep the slots their world size had."""
    import random

    by_size: dict[int, list] = {}
    for item in items:
        by_size.setdefault(world_size(item), []).append(item)
    drawn = {}
    for ws, group in by_size.items():
        group = sorted(group, key=lambda it: it.nodeid)
        random.Random(f"{seed}/ws{ws}").shuffle(group)
        drawn[ws] = iter(group)
    return [next(drawn[world_size(item)]) for item in items]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if isinstance(item, CheckItem) and call.when == "call":
        rep.rank_results = [r.__dict__.copy() for r in item.rank_results]
        if rep.failed and item.expectation is None and isinstance(rep.longrepr, str):
            from conformance import deviations  # a known deviation of a base it does not inherit?

            impl = _session(item.config).impls[item.meta.impl_spec]
            rep.longrepr += deviations.inherit_hint(item.meta, impl, item.rank_results)
    return rep


def pytest_report_header(config):
    session = _session(config)
    lines = [
        "fsdp conformance: implementations "
        + ", ".join(f"{i.name} ({i.version})" for i in session.impls.values())
    ]
    lines.append(
        "  world sizes "
        + ", ".join(f"{ws} ({d}/{b})" for ws, (d, b) in session.placement.items())
        + (" [torchrun: in-process]" if session.torchrun else "")
    )
    return lines


class _Recorder:
    """Collects one record per case from the reports pytest produces."""

    def __init__(self, config):
        self.config = config

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        session = _session(self.config)
        meta = session.meta.get(report.nodeid)
        if meta is None:
            return
        outcome = report_outcome(report)
        if outcome is None:
            return
        prev = session.records.get(report.nodeid)
        if prev is not None and prev["outcome"] == "fail":
            return  # keep the first failure (e.g. a teardown error after a call failure)
        session.records[report.nodeid] = reporting.case_record(report, meta, outcome)


def pytest_report_teststatus(report, config):
    """A not-supported case is its own category in pytest's progress (``n``) and closing line
    (``709 not-supported``), so that line counts what the matrix counts; ``skipped`` there is
    every other skip, as in the matrix."""
    if (
        report.skipped
        and _SESSION_KEY in config.stash
        and report.nodeid in _session(config).meta
        and report_outcome(report) == "not-supported"
    ):
        return "not-supported", "n", "NOT SUPPORTED"
    return None


def report_outcome(report) -> str | None:
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            return "xfail" if report.skipped else ("fail" if report.failed else "pass")
        if report.skipped:
            msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            return "not-supported" if "NotSupported" in msg else "skip"
        return "pass" if report.passed else "fail"
    if report.when == "teardown" and report.failed:
        return "fail"
    return None


def pytest_sessionstart(session):
    session.config.pluginmanager.register(_Recorder(session.config), "fsdp-conformance-recorder")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = _session(config)
    session.close_group()
    if not session.is_reporter:
        return
    wall = time.time() - session.started
    # Stale entries need every check module imported (seconds): an interrupted run, which has
    # a grace period to finish in, does not judge them.
    stale = [] if session.interrupted else session.stale_entries()
    # the reports first: printing can fail (a closed pipe) or be cut short (a second signal)
    _finish_reports(session, wall, stale)
    reporting.terminal_summary(terminalreporter, session, wall, stale)
