"""The accelerator run in one command, bounded to 8 minutes (docs/gpu.md).

``tools/gpu_check.sh OUT_DIR`` (or ``python3 tools/gpu_check.py OUT_DIR``) runs, on a machine with
a CUDA torch, pytest, pytest-benchmark and hypothesis (no nox, no network):

1. ``conformance-ws1``: the four built-ins at world size 1 on ``--device cuda --backend nccl``;
2. ``conformance-multi``: the same at world sizes 2, 4, 8 capped at the GPU count (skipped on one
   GPU);
3. ``perf-quick``: ``pytest perf --quick`` (every timed path once, for correctness);
4. ``perf-timed``: a short timed run of ``reference`` and ``torch-fsdp2`` at world size 1;

and writes every report under ``OUT_DIR`` (one directory per step, its log beside it) and
``OUT_DIR/summary.md``: torch and device, each step's status and time, conformance totals per
implementation, and the perf ratios reference / upstream and reference / floor at world size 1.
A step that fails is reported and the next one runs; a step that outlives its share of the budget
gets SIGTERM (the suites then write their partial reports) and, ``TERM_GRACE`` seconds later,
SIGKILL. ``--device cpu`` (or ``GPU_CHECK_DEVICE=cpu``) runs the same steps on CPU/gloo, so that
on the device only CUDA can fail. Knobs for a shorter run (the project's own test uses them):
``GPU_CHECK_K`` (a ``-k`` for the conformance steps), ``GPU_CHECK_PERF_K`` (for the perf steps),
``GPU_CHECK_BUDGET`` / ``GPU_CHECK_SIZES`` (the timed perf run's ``--budget`` / ``--sizes``),
``GPU_CHECK_WORLD_SIZES`` (the multi-rank step's world sizes) and ``GPU_CHECK_IMPL``.
Exit code: 0 when every step passed, 1 when one did not, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET = 480.0  # seconds for the whole check; the step shares below add up to it
SHARES = {  # seconds per step, SIGTERM grace included
    "environment": 30.0,
    "conformance-ws1": 150.0,
    "conformance-multi": 120.0,
    "perf-quick": 80.0,
    "perf-timed": 100.0,
}
TERM_GRACE = 20.0  # seconds between SIGTERM and SIGKILL, inside a step's share
BUILTINS = "torch-fsdp2,torch-fsdp1,reference,reference-fsdp1"
GPU_SIZES = (2, 4, 8)  # the multi-rank step on GPUs (the suite's own default, capped)
OUTCOMES = ("pass", "fail", "xfail", "not-supported", "skip")
NOT_NEEDED = "skipped: no world size above 1"  # the only skip that is not a failure
CONFORMANCE_EXIT = {
    1: "failing cases",
    2: "usage error",
    3: "internal error",
    5: "no case selected",
}
assert sum(SHARES.values()) <= TOTAL_BUDGET


@dataclass
class Step:
    name: str
    argv: list[str]
    share: float
    reports: Path | None = None  # the step's report directory
    status: str = "not run"
    seconds: float = 0.0
    ok: bool = False
    label: str = ""  # shown instead of the command line

    def command(self) -> str:
        return self.label or " ".join(shlex.quote(a) for a in self.argv)


def run_step(step: Step, out: Path, env: dict, deadline: float) -> None:
    """Run ``step`` with its output in ``out/<name>.log``, within its share and ``deadline``."""
    limit = min(step.share, deadline - time.monotonic())
    if limit <= TERM_GRACE:
        step.status = "skipped: the 8-minute budget is spent"
        return
    if step.reports is not None:  # pytest-benchmark < 5.3 opens --benchmark-json at parse time
        step.reports.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(out / f"{step.name}.log", "w") as log:
        log.write(f"$ {step.command()}\n")
        log.flush()
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(limit - TERM_GRACE)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)  # the suites write partial reports on SIGTERM
            try:
                code = proc.wait(TERM_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    step.seconds = time.monotonic() - start
    if timed_out:
        step.status = f"timeout: stopped after {limit - TERM_GRACE:.0f} s (exit {code}); partial"
    elif code == 0:
        step.status, step.ok = "ok", True
    else:
        why = CONFORMANCE_EXIT.get(code, "") if step.name.startswith("conformance") else ""
        step.status = f"failed: exit {code}" + (f" ({why})" if why else "")


def probe(python: str, out: Path, env: dict, deadline: float) -> tuple[Step, dict]:
    """The torch build and its devices, from a subprocess (CUDA's first call can hang)."""
    code = (
        "import json, platform, torch\n"
        "cuda = torch.cuda.is_available()\n"
        "info = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': "
        "platform.python_version(), 'cuda_available': cuda, 'gpus': torch.cuda.device_count() "
        "if cuda else 0}\n"
        "info['names'] = [torch.cuda.get_device_name(i) for i in range(info['gpus'])]\n"
        "try:\n"
        "    info['nccl'] = '.'.join(map(str, torch.cuda.nccl.version())) if cuda else None\n"
        "except Exception as exc:\n"
        "    info['nccl'] = f'unknown ({exc})'\n"
        f"open({str(out / 'environment.json')!r}, 'w').write(json.dumps(info, indent=1))\n"
        "print(json.dumps(info))\n"
    )
    step = Step("environment", [python, "-c", code], SHARES["environment"])
    step.label = f"{python} -c <torch version, devices> (writes environment.json)"
    run_step(step, out, env, deadline)
    path = out / "environment.json"
    return step, json.loads(path.read_text()) if path.exists() else {}


def plan(args, info: dict, out: Path) -> list[Step]:
    py, device = args.python, args.device
    backend = "nccl" if device == "cuda" else "gloo"
    placement = ["--device", device, "--backend", backend]
    impls = os.environ.get("GPU_CHECK_IMPL", BUILTINS)
    k = ["-k", os.environ["GPU_CHECK_K"]] if os.environ.get("GPU_CHECK_K") else []
    perf_k = ["-k", os.environ["GPU_CHECK_PERF_K"]] if os.environ.get("GPU_CHECK_PERF_K") else []
    quiet = ["-p", "no:cacheprovider"]
    if os.environ.get("GPU_CHECK_WORLD_SIZES") == "none":
        multi = []
    elif os.environ.get("GPU_CHECK_WORLD_SIZES"):
        multi = sorted({int(w) for w in os.environ["GPU_CHECK_WORLD_SIZES"].split(",") if w})
    elif device == "cuda":
        multi = [ws for ws in GPU_SIZES if ws <= info.get("gpus", 0)]
    else:
        multi = [2]
    steps = []

    def conformance(name: str, sizes: list[int]) -> Step:
        reports = out / name
        argv = [py, "-m", "conformance", "--impl", impls, *placement, "--world-sizes",
                ",".join(map(str, sizes)), "--reports-dir", str(reports), *k, *quiet]  # fmt: skip
        return Step(name, argv, SHARES[name], reports)

    steps.append(conformance("conformance-ws1", [1]))
    multi_step = conformance("conformance-multi", multi or [2])
    if not multi:
        multi_step.status = f"{NOT_NEEDED}: {info.get('gpus', 0)} GPU(s)"
    steps.append(multi_step)
    quick_sizes = "1,2" if 2 in multi else "1"
    argv = [py, "-m", "pytest", "perf", "--quick", "-q", *placement, "--world-sizes", quick_sizes,
            "--perf-reports-dir", str(out / "perf-quick"), *perf_k, *quiet]  # fmt: skip
    steps.append(Step("perf-quick", argv, SHARES["perf-quick"], out / "perf-quick"))
    budget = os.environ.get("GPU_CHECK_BUDGET", "0.5")
    sizes = os.environ.get("GPU_CHECK_SIZES", "large:1,64;small:1;uneven:1,32")
    perf = out / "perf"
    argv = [py, "-m", "pytest", "perf", "-q", "--impl", "reference,torch-fsdp2", *placement,
            "--world-sizes", "1", "--budget", budget, "--sizes", sizes, "--benchmark-json",
            str(perf / "perf.json"), "--perf-reports-dir", str(perf), *perf_k, *quiet]  # fmt: skip
    steps.append(Step("perf-timed", argv, SHARES["perf-timed"], perf))
    return steps


# ------------------------------------------------------------------------------------ summary
def conformance_report(directory: Path) -> tuple[dict | None, str]:
    """The step's conformance.json (a finished run's, else the newest partial one) and its path."""
    finished = directory / "conformance.json"
    candidates = [finished] if finished.exists() else []
    candidates += sorted(directory.glob("runs/*/conformance.json"), reverse=True)
    for path in candidates:
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, ValueError):
            continue
    return None, ""


def conformance_lines(step: Step) -> list[str]:
    doc, path = conformance_report(step.reports) if step.reports else (None, "")
    if doc is None:
        return [f"No report from `{step.name}`.", ""]
    partial = " **(partial: the run was interrupted)**" if doc.get("interrupted") else ""
    lines = [f"`{step.name}`: {len(doc['cases'])} cases, `{path}`{partial}", ""]
    lines += ["| implementation | ws | " + " | ".join(OUTCOMES) + " | total |"]
    lines += ["|---|---|" + "---|" * (len(OUTCOMES) + 1)]
    counts: dict[tuple[str, int], Counter] = {}
    for case in doc["cases"]:
        counts.setdefault((case["impl"], case["world_size"]), Counter())[case["outcome"]] += 1
    for (impl, ws), c in sorted(counts.items()):
        cells = " | ".join(str(c[o]) for o in OUTCOMES)
        lines.append(f"| {impl} | {ws} | {cells} | {sum(c.values())} |")
    failing = [c for c in doc["cases"] if c["outcome"] == "fail"]
    if failing:
        lines += ["", f"Failing cases ({len(failing)}; the first 20, rerun lines in the report):"]
        for case in failing[:20]:
            first = (case.get("message") or "").strip().splitlines()[:1]
            lines.append(f"- `{case['impl']} {case['id']}`: {first[0][:200] if first else ''}")
    return lines + [""]


def perf_lines(path: Path) -> list[str]:
    """Reference / upstream and reference / floor per timed step at world size 1."""
    try:
        records = [b["extra_info"] for b in json.loads(path.read_text())["benchmarks"]]
    except (OSError, ValueError, KeyError):
        return [f"No perf report ({path}).", ""]
    records = [r for r in records if r.get("world_size") == 1 and "median_s" in r]

    def key(r):
        return (r["area"], r["path"], r.get("kind", ""), r["shape_set"], r["size_mb"])

    upstream = {key(r): r for r in records if r.get("impl") == "torch-fsdp2"}
    rows = [r for r in records if r.get("impl") == "reference" and "ratio_to_floor" in r]
    if not rows:
        return ["No timed reference step at world size 1 in the perf report.", ""]
    lines = [
        "Times are medians over rounds of the slowest rank; `ref / floor` divides by the floor "
        "timed in the same task (a raw all-gather of the same bytes, memcpy, the raw gather of a "
        "state dict); `ref / upstream` by torch-fsdp2's median (the paired area: the two "
        "interleaved in one task).",
        "",
        "| area | step | shapes | reference ms | torch-fsdp2 ms | ref / upstream | ref / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=key):
        up = upstream.get(key(r))
        paired = r["area"] == "paired"
        vs = r["ratio_to_floor"] if paired else r.get("vs_torch_fsdp2")
        floor = "" if paired else f"{r['ratio_to_floor']:.2f}×"
        step = f"{r.get('kind') + ' ' if r.get('kind') else ''}{r['path']}"
        up_ms = f"{up['median_s'] * 1e3:.3f}" if up else ""
        lines.append(
            f"| {r['area']} | {step} | {r['shape_set']} {r['size_mb']:g} MiB | "
            f"{r['median_s'] * 1e3:.3f} | {up_ms} | {'' if vs is None else f'{vs:.2f}×'} | "
            f"{floor} |"
        )
    return lines + [""]


def write_summary(out: Path, args, info: dict, steps: list[Step], wall: float) -> Path:
    names = ", ".join(info.get("names") or []) or "none"
    lines = [
        "# GPU check",
        "",
        f"- created: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, wall {wall:.0f} s "
        f"(budget {TOTAL_BUDGET:.0f} s)",
        f"- device: `--device {args.device}`; torch {info.get('torch', '?')}, CUDA "
        f"{info.get('cuda')}, NCCL {info.get('nccl')}, Python {info.get('python', '?')}",
        f"- GPUs: {info.get('gpus', 0)} ({names})",
        "",
        "## Steps",
        "",
        "| step | status | seconds | reports | command |",
        "|---|---|---|---|---|",
    ]
    for s in steps:
        reports = f"`{s.reports}`" if s.reports else ""
        lines.append(
            f"| {s.name} | {s.status} | {s.seconds:.0f} | {reports} | `{s.command()[:300]}` |"
        )
    lines += ["", "## Conformance totals", ""]
    for s in steps:
        if s.name.startswith("conformance") and not s.status.startswith("skipped"):
            lines += conformance_lines(s)
    lines += ["## Perf at world size 1", ""]
    lines += perf_lines(out / "perf" / "perf.json")
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="a new or empty directory for every report")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=os.environ.get("GPU_CHECK_DEVICE", "cuda"),
        help="cuda (default; $GPU_CHECK_DEVICE) or cpu: the same steps on CPU/gloo",
    )
    parser.add_argument("--python", default=sys.executable, help="the Python that has torch")
    args = parser.parse_args(argv)
    out = Path(args.out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.stderr.write(f"gpu_check: {out} is not an empty directory; pass a new one\n")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + TOTAL_BUDGET
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FSDP_CONFORMANCE_IMPL", None)  # the steps name their implementations
    env_step, info = probe(args.python, out, env, deadline)
    steps = [env_step]
    if args.device == "cuda" and not info.get("cuda_available"):
        env_step.ok, env_step.status = False, "failed: torch.cuda.is_available() is False"
    print(f"gpu_check: torch {info.get('torch')}, {info.get('gpus', 0)} GPU(s)", flush=True)
    for step in plan(args, info, out):
        steps.append(step)
        if step.status == "not run":
            run_step(step, out, env, deadline)
        print(f"gpu_check: {step.name}: {step.status} ({step.seconds:.0f} s)", flush=True)
        write_summary(out, args, info, steps, time.monotonic() - started)
    path = write_summary(out, args, info, steps, time.monotonic() - started)
    print(f"gpu_check: summary {path}", flush=True)
    return 0 if all(s.ok or s.status.startswith(NOT_NEEDED) for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
