"""The perf suite's driver side: options, cases, one worker group per world size, records.

``nox -s perf`` (or ``python -m pytest perf [options]``) runs every benchmark of ``perf/test_*.py``
for every selected implementation, world size and shape configuration. Each case sends ONE task to
the ranks of a reused :class:`conformance.runner.pool.WorkerGroup` (cached: the pieces of one path
share a task); the task measures the path and its floor interleaved (``perf/_bodies/timing.py``),
returns per-rank round times, and the driver keeps the slowest rank per round. Those times go into
pytest-benchmark through a virtual clock (``perf/_clock.py``); ``extra_info`` carries the record
(bytes, ratios, bandwidths, world size, implementation). At the end ``reports/perf.md`` (quick mode:
``reports/perf-quick.md``) and PNG plots are written (``perf/report.py``, ``perf/plots.py``).

``--quick`` runs every benchmark once with one round and no warm-up: a correctness run, no timing
claims (``nox -s tests`` runs it).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from perf import _clock

DEFAULT_IMPLS = ("reference", "torch-fsdp2", "torch-fsdp1", "reference-fsdp1")
OPTIONAL_IMPLS = {"reference", "reference-fsdp1"}  # dropped with a note while not importable
FULL_SIZES = {"large": (1, 8, 64), "small": (1, 4), "uneven": (1, 32)}
# The DCP helpers cost ~10 ms per parameter and call on 2 CPU cores: the many-small set at 4 MiB
# (256 parameters) alone would take minutes per implementation, so state dicts (and the paired
# area, which measures one) stop at this size for it (override with --sizes, which applies to every
# area as given).
STATE_DICT_SMALL_MAX_MB = 1
QUICK_SIZES = {"small": (0.25,), "uneven": (1,)}  # every path once; "large" is the easy case
BASELINE = "baseline"  # impl column of the harness-only floors (no implementation involved)


def pytest_addoption(parser):
    g = parser.getgroup("fsdp perf")
    g.addoption(
        "--impl",
        default=None,
        help="comma-separated implementations (same specs as the conformance suite; "
        "default: reference,torch-fsdp2,torch-fsdp1,reference-fsdp1, the reference "
        "ones only when importable)",
    )
    g.addoption(
        "--world-sizes",
        default=None,
        help="comma-separated world sizes (default 1,2,4 on CPU; 1,2,4,8 capped at the GPU "
        "count on GPUs; quick mode: 1,2)",
    )
    g.addoption(
        "--device", default=None, help="device type (default: auto, as the conformance suite)"
    )
    g.addoption("--backend", default=None, help="process-group backend (default: the device's)")
    g.addoption(
        "--threads-per-rank", type=int, default=1, help="torch threads per rank (default 1)"
    )
    g.addoption(
        "--quick",
        action="store_true",
        help="run every benchmark once for correctness only (no warm-up, one round, no "
        "timing claims)",
    )
    g.addoption(
        "--sizes",
        default=None,
        help="shape sets and sizes in MiB, e.g. 'large:1,8,64;small:1,4;uneven:1,32' (the default)",
    )
    g.addoption(
        "--budget",
        type=float,
        default=1.0,
        help="seconds of measured rounds per task (rounds = budget / warm-up round, "
        "clamped to [3, 30]; the paired area: 9 blocks of [2, 22]; default 1.0)",
    )
    g.addoption(
        "--cpu-allocator",
        choices=("reuse", "system"),
        default="reuse",
        help="CPU ranks: 'reuse' (default) keeps freed memory in glibc's heap, as a GPU caching "
        "allocator would, so that a path is not charged for page-faulting fresh buffers; "
        "'system' leaves glibc's defaults (large buffers are mmapped and faulted in anew)",
    )
    g.addoption("--task-timeout", type=float, default=600.0, help="seconds per task (default 600)")
    g.addoption("--perf-reports-dir", default="reports", help="where perf.md and the plots go")


# ---------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    area: str  # allgather / padding / state_dict / paired
    ws: int
    impl: str  # implementation name, or BASELINE
    spec: str | None  # implementation spec sent to the ranks (None for the baseline)
    style: str  # fsdp2 / fsdp1 / baseline
    shape_set: str
    size_mb: float
    step: str  # the timed step this case reports (a key of the task's times)
    floor: str | None  # the step it is compared with, measured in the same task
    kind: str = ""  # state-dict kind
    skip: str = ""  # reason this piece is not measured (reported, never faked)

    @property
    def id(self) -> str:
        kind = f"{self.kind}-" if self.kind else ""
        return f"ws{self.ws}-{self.impl}-{self.shape_set}{self.size_mb:g}MB-{kind}{self.step}"

    @property
    def fn(self) -> str:
        return f"perf._bodies.{self.area}:{'floors' if self.style == BASELINE else self.style}"

    @property
    def task_key(self) -> tuple:
        return (self.ws, self.fn, self.spec, self.shape_set, self.size_mb)  # kinds share a task

    @property
    def key(self) -> str:
        """The task's times key: state-dict tasks measure every kind, as ``<kind>/<step>``."""
        return f"{self.kind}/{self.step}" if self.kind else self.step

    @property
    def floor_key(self) -> str | None:
        return (
            None
            if self.floor is None
            else (f"{self.kind}/{self.floor}" if self.kind else self.floor)
        )


FSDP1_NO_PIECES = (
    "not measured: a flat parameter all-gathers its padded shard in place (no "
    "copy-in) and unflattens into views (no copy-out); only end to end is reachable"
)
FSDP1_NO_REPAD = (
    "not measured: FSDP1 has no per-parameter re-pad; its load paths are in the "
    "state-dict benchmarks"
)


def _cases_for(area: str, perf: PerfSession) -> list[Case]:
    from perf._bodies.state_dict import FSDP1_KINDS, FSDP2_KINDS

    out = []
    for ws in perf.world_sizes:
        for shape_set, sizes in perf.sizes.items():
            for size in sizes:
                if (
                    area in ("state_dict", "paired")
                    and shape_set == "small"
                    and not perf.sizes_given
                    and size > STATE_DICT_SMALL_MAX_MB
                ):
                    continue

                def add(
                    impl, spec, style, step, floor, kind="", skip="", _at=(ws, shape_set, size)
                ):
                    out.append(
                        Case(
                            area, _at[0], impl, spec, style, _at[1], _at[2], step, floor, kind, skip
                        )
                    )

                if area == "allgather":
                    add(BASELINE, None, BASELINE, "floor", None)
                    add(BASELINE, None, BASELINE, "naive", "floor")
                for spec, impl in perf.impls.items():
                    style = perf.styles[spec]
                    if area == "allgather":
                        add(impl.name, spec, style, "floor", None)
                        add(impl.name, spec, style, "e2e", "floor")
                        for piece in ("copy_in", "unshard", "copy_out"):
                            add(
                                impl.name,
                                spec,
                                style,
                                piece,
                                "floor",
                                skip=FSDP1_NO_PIECES
                                if style == "fsdp1" and piece != "unshard"
                                else "",
                            )
                    elif area == "paired":  # an FSDP2-style impl against upstream, one task
                        if style == "fsdp2" and not is_upstream(impl):
                            for step in ("unshard", "full_sd"):
                                add(impl.name, spec, style, step, f"{step}_upstream")
                    elif area == "padding":
                        add(impl.name, spec, style, "memcpy", None)
                        for step in ("construct", "load_assign", "reset"):
                            if style == "fsdp1" and step != "construct":
                                add(impl.name, spec, style, step, "memcpy", skip=FSDP1_NO_REPAD)
                            else:
                                add(impl.name, spec, style, step, "memcpy")
                    elif area == "state_dict":
                        kinds = FSDP1_KINDS if style == "fsdp1" else FSDP2_KINDS
                        for kind in kinds:
                            full = "full" in kind
                            if full:
                                add(impl.name, spec, style, "floor", None, kind)
                            add(impl.name, spec, style, "save", "floor" if full else None, kind)
                            if "rank0" not in kind or style == "fsdp2":
                                add(impl.name, spec, style, "load", "floor" if full else None, kind)
    # FSDP1 has no unshard piece either: keep only end to end for it
    return [c for c in out if not (c.style == "fsdp1" and c.step == "unshard")]


def is_upstream(impl) -> bool:
    """Whether ``impl``'s API namespace (``ns``, declared with ``fsdp2-api``) is upstream's own
    ``torch.distributed.fsdp``, the other side of every paired case: paired with itself it would
    measure nothing. Declared data, never the implementation's name."""
    import torch.distributed.fsdp as upstream

    return getattr(impl, "ns", None) is upstream


# ---------------------------------------------------------------------------------------- session
@dataclass
class TaskResult:
    times: dict[str, list[float]] = field(default_factory=dict)  # slowest rank per round
    info: dict = field(default_factory=dict)
    error: str = ""
    not_supported: str = ""
    loadavg: float = 0.0


class PerfSession:
    def __init__(self, config):
        from conformance import devices
        from conformance.adapters.registry import (
            ImplementationLoadError,
            load_implementation,
            split_specs,
        )

        opt = config.option
        self.config = config
        self.quick = opt.quick
        self.started = time.time()
        self.notes: list[str] = []
        specs = split_specs(opt.impl) if opt.impl else list(DEFAULT_IMPLS)
        self.impls, self.styles = {}, {}
        for spec in specs:
            try:
                impl = load_implementation(spec)
                caps = set(impl.capabilities)
                if "fsdp2-api" in caps:
                    impl.ns.fully_shard  # noqa: B018 - resolves the lazy export: importable?
                    self.styles[spec] = "fsdp2"
                elif "fsdp1-api" in caps:
                    impl.ns.FullyShardedDataParallel  # noqa: B018
                    self.styles[spec] = "fsdp1"
                else:
                    self.notes.append(
                        f"{impl.name}: declares neither fsdp2-api nor fsdp1-api; "
                        "the perf bodies need one of them: not benchmarked"
                    )
                    continue
                self.impls[spec] = impl
            except Exception as exc:  # noqa: BLE001
                if opt.impl is None and spec in OPTIONAL_IMPLS:
                    self.notes.append(
                        f"{spec}: not importable yet ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]}); its columns are absent"
                    )
                    continue
                if isinstance(exc, ImplementationLoadError):
                    raise
                raise ImplementationLoadError(f"{spec}: {type(exc).__name__}: {exc}") from exc
        if opt.world_sizes:
            self.world_sizes = sorted({int(w) for w in opt.world_sizes.split(",") if w.strip()})
        elif self.quick:
            self.world_sizes = [1, 2]
        else:
            defaults = devices.default_world_sizes(opt.device)
            self.world_sizes = [1, 2, 4] if defaults == list(devices.CPU_WORLD_SIZES) else defaults
        self.placement = {
            ws: devices.choose(ws, opt.device, opt.backend) for ws in self.world_sizes
        }
        if opt.cpu_allocator == "reuse" and any(d == "cpu" for d, _ in self.placement.values()):
            self.notes.append(_reuse_cpu_memory())
        self.sizes = (
            _parse_sizes(opt.sizes) if opt.sizes else (QUICK_SIZES if self.quick else FULL_SIZES)
        )
        self.sizes_given = bool(opt.sizes)
        self.groups: dict[int, object] = {}
        self.cache: dict[tuple, TaskResult] = {}
        self.records: list[dict] = []
        self.timing = (
            {}
            if self.quick
            else {"budget_s": opt.budget, "min_rounds": 3, "max_rounds": 30, "warmup": 1}
        )

    def group(self, ws: int):
        from conformance.runner.pool import WorkerGroup

        for other in [w for w in self.groups if w != ws]:  # one group alive at a time (memory)
            self.groups.pop(other).close()
        if ws not in self.groups:
            device, backend = self.placement[ws]
            self.groups[ws] = WorkerGroup(
                ws, device, backend, threads_per_rank=self.config.option.threads_per_rank
            )
        return self.groups[ws]

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()

    def task(self, case: Case) -> TaskResult:
        from conformance.runner import protocol
        from conformance.runner.protocol import Task

        if case.task_key in self.cache:
            return self.cache[case.task_key]
        kwargs = {
            "shape_set": case.shape_set,
            "size_mb": case.size_mb,
            "quick": self.quick,
            **self.timing,
        }
        results = self.group(case.ws).run(
            Task(case.fn, case.spec, kwargs, self.config.option.task_timeout)
        )
        out = TaskResult(loadavg=os.getloadavg()[0])
        bad = [r for r in results if r.status not in (protocol.OK, protocol.NOT_SUPPORTED)]
        unsupported = [r for r in results if r.status == protocol.NOT_SUPPORTED]
        if bad:
            out.error = "\n".join(
                f"rank {r.rank}: {r.status}\n{r.detail.rstrip()}"
                for r in results
                if r.status != protocol.OK
            )
        elif unsupported:
            out.not_supported = unsupported[0].detail
        else:
            steps = results[0].value["times"]
            out.times = {
                s: [max(r.value["times"][s][i] for r in results) for i in range(len(ts))]
                for s, ts in steps.items()
            }
            out.info = results[0].value["info"]
        self.cache[case.task_key] = out
        return out

    # ------------------------------------------------------------------------------ one case
    def run_case(self, benchmark, case: Case) -> None:
        if case.skip:
            pytest.skip(case.skip)
        result = self.task(case)
        if result.error:
            pytest.fail(
                f"{case.fn} on {case.impl} (ws {case.ws}) failed:\n{result.error}", pytrace=False
            )
        if result.not_supported:
            pytest.skip(f"not supported: {result.not_supported}")
        if case.kind in result.info.get("skipped", {}):
            pytest.skip(f"not run: {result.info['skipped'][case.kind]}")
        times = result.times[case.key]
        record = make_record(case, result, self)
        benchmark.group = f"{case.area} ws{case.ws} {case.shape_set}-{case.size_mb:g}MB"
        benchmark.extra_info.update(record)
        _clock.feed(times)
        benchmark.pedantic(_clock.advance, rounds=len(times), iterations=1)
        self.records.append(benchmark.extra_info)


def make_record(case: Case, result: TaskResult, perf: PerfSession) -> dict:
    times = result.times[case.key]
    info = result.info
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [med, med, med]
    impl = perf.impls.get(case.spec) if case.spec else None
    device, backend = perf.placement[case.ws]
    rec = {
        "area": case.area,
        "path": case.step,
        "kind": case.kind,
        "impl": case.impl,
        "impl_version": impl.version if impl else "",
        "style": case.style,
        "world_size": case.ws,
        "device": device,
        "backend": backend,
        "threads_per_rank": perf.config.option.threads_per_rank,
        "shape_set": case.shape_set,
        "size_mb": case.size_mb,
        "quick": perf.quick,
        "rounds": len(times),
        "median_s": med,
        "q1_s": q[0],
        "q3_s": q[2],
        "min_s": min(times),
        "max_s": max(times),
        "iqr_rel": (q[2] - q[0]) / med if med else 0.0,
        "loadavg_1m": result.loadavg,
        **{
            k: info[k]
            for k in (
                "unpadded_bytes",
                "padded_bytes",
                "payload_efficiency",
                "num_params",
                "gather_bytes",
                "local_padded_bytes",
            )
            if k in info
        },
    }
    if case.floor_key and case.floor_key in result.times:
        floor_med = statistics.median(result.times[case.floor_key])
        rec["floor"] = case.floor
        rec["floor_median_s"] = floor_med
        rec["ratio_to_floor"] = med / floor_med if floor_med else None
        floor_times = result.times[case.floor_key]
        if len(floor_times) == len(times) and all(floor_times):  # same rounds, paired
            # each round's time over its floor's in the same round: the report's paired statistics
            rec["round_ratios"] = [t / f for t, f in zip(times, floor_times)]
            blocks = info.get("round_blocks", {}).get(case.step)
            if blocks and sum(blocks) == len(times):  # rounds in blocks over fresh allocations
                rec["round_blocks"] = list(blocks)
                starts = [sum(blocks[:b]) for b in range(len(blocks))]
                rec["block_ratios"] = [
                    statistics.median(rec["round_ratios"][s : s + n])
                    for s, n in zip(starts, blocks)
                ]
    nbytes = info.get("local_padded_bytes") if case.area == "padding" else info.get("gather_bytes")
    if nbytes and med:
        if case.area == "padding":
            rec["gbps"] = nbytes / med / 1e9
        elif case.area == "allgather" or case.step == "floor" or "full" in case.kind:
            rec["algbw_gbps"] = nbytes / med / 1e9
            rec["busbw_gbps"] = rec["algbw_gbps"] * (case.ws - 1) / case.ws
    if case.area == "state_dict" and info.get("num_params"):
        rec["per_param_us"] = med / info["num_params"] * 1e6
    return rec


def add_cross_ratios(records: list[dict]) -> None:
    """``vs_torch_fsdp2`` / ``vs_torch_fsdp1``: this median over upstream's for the same case."""

    def case(record: dict, impl: str) -> tuple:
        fields = ("area", "path", "kind", "world_size", "shape_set", "size_mb")
        return (*(record[f] for f in fields), impl)

    index = {case(r, r["impl"]): r for r in records}
    for r in records:
        for upstream in ("torch-fsdp2", "torch-fsdp1"):
            other = index.get(case(r, upstream))
            if other and other["median_s"]:
                r["vs_" + upstream.replace("-", "_")] = r["median_s"] / other["median_s"]


def _parse_sizes(text: str) -> dict[str, tuple[float, ...]]:
    from perf._bodies.shapes import SHAPE_SETS

    out = {}
    for part in text.split(";"):
        if part.strip():
            name, _, sizes = part.partition(":")
            if name.strip() not in SHAPE_SETS:
                raise pytest.UsageError(
                    f"--sizes: unknown shape set {name!r} (known: {SHAPE_SETS})"
                )
            out[name.strip()] = tuple(float(s) for s in sizes.split(",") if s.strip())
    return out


# ---------------------------------------------------------------------------------------- hooks
# [Note: CPU allocations in the ranks]
# A tensor of 32 MiB or more is mmapped by glibc and page-faulted in on first touch: on this kind of
# machine a fresh 64 MiB buffer filled by a copy costs about 6x a copy into a warm buffer. A GPU
# caching allocator hides that cost, and it is not part of any FSDP algorithm, so by default the
# ranks (spawned processes, which read these variables at start-up) keep freed memory in the heap.
_GLIBC_REUSE = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def _reuse_cpu_memory() -> str:
    """Set the glibc variables for ranks spawned from now on (a user's own values win)."""
    for name, value in _GLIBC_REUSE.items():
        os.environ.setdefault(name, value)
    shown = ", ".join(f"{n}={os.environ[n]}" for n in _GLIBC_REUSE)
    return (
        f"CPU ranks reuse freed memory ({shown}), as a GPU caching allocator would; "
        "--cpu-allocator system measures with fresh page-faulted buffers"
    )


_KEY = pytest.StashKey[PerfSession]()


def pytest_configure(config):
    from conformance.adapters.registry import ImplementationLoadError

    if not hasattr(config.option, "quick"):  # conftest not active for this invocation
        return
    try:
        config.stash[_KEY] = PerfSession(config)
    except ImplementationLoadError as exc:
        pytest.exit(f"fsdp perf: {exc}", returncode=2)
    if config.option.quick and hasattr(config.option, "benchmark_disable"):
        config.option.benchmark_disable = True  # no timing claims in quick mode


@pytest.fixture(scope="session")
def perf(request) -> PerfSession:
    return request.config.stash[_KEY]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        area = metafunc.module.AREA
        cases = _cases_for(area, metafunc.config.stash[_KEY])
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def pytest_collection_modifyitems(session, config, items):
    # all cases of one world size together (one group alive at a time), then by task
    def key(item):
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        return (case.ws, str(case.task_key)) if case else (0, "")

    items.sort(key=key)


def pytest_report_header(config):
    if _KEY not in config.stash:
        return None
    perf = config.stash[_KEY]
    lines = [
        "fsdp perf: "
        + ", ".join(f"{i.name} ({i.version})" for i in perf.impls.values())
        + (" [quick: correctness only]" if perf.quick else "")
    ]
    lines.append(
        "  world sizes "
        + ", ".join(f"{ws} ({d}/{b})" for ws, (d, b) in perf.placement.items())
        + f"; threads/rank {config.option.threads_per_rank}; sizes {perf.sizes}"
    )
    lines += [f"  note: {n}" for n in perf.notes]
    return lines


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Outside pytest-benchmark's own wrapper (which writes its JSON before yielding): the cross
    ratios go into ``extra_info`` first, then our reports."""
    if _KEY in session.config.stash:
        _finish(session)
    yield


def _finish(session) -> None:
    perf = session.config.stash[_KEY]
    perf.close()
    if not perf.records:
        return
    add_cross_ratios(perf.records)
    from perf import report

    out = Path(session.config.option.perf_reports_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "wall_s": time.time() - perf.started,
        "notes": perf.notes,
        "quick": perf.quick,
        "impls": {i.name: i.version for i in perf.impls.values()},
        "world_sizes": perf.world_sizes,
        "placement": perf.placement,
        "threads_per_rank": session.config.option.threads_per_rank,
    }
    path = report.write(perf.records, out / ("perf-quick.md" if perf.quick else "perf.md"), meta)
    perf.notes.append(f"report: {path}")
    if not perf.quick:  # the ratio tables and the targets, printed at the end of the run
        perf.summary = report.terminal_tables(perf.records)
    if not perf.quick:
        try:
            from perf import plots

            for p in plots.write(perf.records, out):
                perf.notes.append(f"plot: {p}")
        except ImportError as exc:
            perf.notes.append(f"plots skipped: {exc} (nox -s perf installs matplotlib)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _KEY in config.stash:
        summary = getattr(config.stash[_KEY], "summary", None)
        if summary:
            terminalreporter.section("fsdp perf: ratio tables (full report in perf.md)")
            for line in summary.splitlines():
                terminalreporter.write_line(line)
        for note in config.stash[_KEY].notes:
            terminalreporter.write_line(f"fsdp perf: {note}")
