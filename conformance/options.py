"""Checking the command line before anything runs.

Every option of the group "fsdp conformance" is validated here, in the driver, before an
implementation is loaded or a process is started. A bad value raises :class:`UsageError`, whose
text is the one line the user sees (the run then exits with code 2)::

    fsdp conformance: --check-timeout: 'nan' is not a number of seconds > 0; pass e.g. --check-timeout 60
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conformance import devices

DEFAULT_CHECK_TIMEOUT = 60.0


class UsageError(Exception):
    """A bad option or input: ``str()`` is ``--option: what is wrong; what to change``."""

    def __init__(self, option: str, problem: str, fix: str):
        super().__init__(f"{option}: {problem}; {fix}")
        self.option = option


@dataclass
class Options:
    """The validated options (``world_sizes`` None: the device's default)."""

    impl_specs: list[str] | None
    world_sizes: list[int] | None
    device: str | None
    backend: str | None
    check_timeout: float
    grace: float
    threads_per_rank: int
    expectations_dir: Path
    check_dirs: list[Path]
    reports_dir: Path | None  # None: this process writes no reports; see writable_dir
    shuffle: int | None = None  # --shuffle SEED: each world size's cases in a random order
    rank_memory: int | str | None = "default"  # bytes; None: off; "default": MemTotal / (ws + 1)

    def memory_limit(self, world_size: int) -> int | None:
        """Bytes a rank of a ``world_size`` group may hold (see conformance.runner.memory)."""
        from conformance.runner import memory

        if self.rank_memory == "default":
            return memory.default_limit(world_size)
        return self.rank_memory


def seconds(option: str, text, *, allow_zero: bool, example: str) -> float:
    """``text`` as a finite number of seconds (> 0, or >= 0 with ``allow_zero``)."""
    bound = ">= 0" if allow_zero else "> 0"
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UsageError(
            option, f"{text!r} is not a number of seconds {bound}", f"pass e.g. {option} {example}"
        )
    return value


def positive_int(option: str, text, *, example: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(
            option, f"{text!r} is not a whole number >= 1", f"pass e.g. {option} {example}"
        )
    return value


def rank_memory(text: str | None) -> int | str | None:
    """``--rank-memory-limit`` in bytes, None for ``off``, ``"default"`` when not given."""
    from conformance.runner import memory

    if text is None:
        return "default"
    try:
        return memory.parse_size(text)
    except ValueError:
        raise UsageError(
            "--rank-memory-limit",
            f"{text!r} is not a memory size",
            "pass e.g. --rank-memory-limit 6G (or 800M, or off)",
        ) from None


def shuffle_seed(text: str | None) -> int | None:
    if text is None:
        return None
    if not str(text).strip().isdigit():
        raise UsageError(
            "--shuffle", f"{text!r} is not a whole number >= 0", "pass e.g. --shuffle 1"
        )
    return int(str(text).strip())


def world_sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise UsageError("--world-sizes", "no world size given", "pass e.g. --world-sizes 1,2,4")
    sizes = set()
    for part in parts:
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise UsageError(
                "--world-sizes",
                f"{part!r} is not a number of ranks >= 1",
                "pass comma-separated whole numbers, e.g. --world-sizes 1,2,4",
            )
        sizes.add(int(part))
    return sorted(sizes)


def device_type(text: str | None) -> str | None:
    if text is None:
        return None
    import torch

    try:
        kind = torch.device(text).type
    except (RuntimeError, TypeError):
        raise UsageError(
            "--device", f"{text!r} is not a device type", "use cpu, cuda, xpu, hpu, ..."
        ) from None
    if kind != "cpu" and devices.accelerator_count(kind) == 0:
        raise UsageError(
            "--device",
            f"no {kind} device is available here (torch.{kind}.is_available() is False)",
            "use --device cpu, or run on a machine with one",
        )
    return kind


def backend_name(text: str | None, device: str | None) -> str | None:
    if text is None:
        return None
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    name = text.lower()
    if name not in known and name not in getattr(dist.Backend, "_plugins", {}):
        raise UsageError("--backend", f"unknown backend {text!r}", f"use one of {', '.join(known)}")
    available = getattr(dist, "is_backend_available", lambda _: True)(name)
    if not available:
        raise UsageError(
            "--backend",
            f"{name} is not available in this torch build",
            f"use the device's default ({devices.choose(1, device or 'cpu')[1]}) or another torch",
        )
    return name


def existing_dir(option: str, text: str, *, what: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        problem = "is a file, not a directory" if path.exists() else "does not exist"
        raise UsageError(option, f"{text!r} {problem}", f"pass the directory of {what}")
    return path


def check_dir(text: str, rootpath: Path) -> Path:
    path = existing_dir("--check-dir", text, what="your check modules")
    try:
        path.resolve().relative_to(rootpath)
    except ValueError:
        raise UsageError(
            "--check-dir",
            f"{text!r} is outside the rootdir {rootpath} (its modules are imported from there)",
            "move it under the rootdir or run from a directory above it",
        ) from None
    return path


def writable_dir(option: str, text: str) -> Path:
    """Create ``text`` (with parents) and prove a file can be written there, by writing one."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except FileExistsError:
        raise UsageError(option, f"{text!r} is a file", "pass a directory path") from None
    except OSError as exc:
        raise UsageError(
            option,
            f"cannot write into {text!r} ({exc.strerror or exc})",
            "pass a writable directory",
        ) from None
    return path


def validate(opt, rootpath: Path, *, torchrun: bool, writes_reports: bool) -> Options:
    """All options of ``opt`` (pytest's ``config.option``), checked; raises :class:`UsageError`.
    The reports directory is only named here: :func:`writable_dir` creates and probes it, last."""
    impl_specs = None
    if opt.impl is not None:
        impl_specs = [s.strip() for s in str(opt.impl).split(",") if s.strip()]
        if not impl_specs:
            raise UsageError(
                "--impl",
                "no implementation given",
                "pass names or package.module:attr specs, e.g. --impl reference (or drop --impl "
                "for every built-in)",
            )
    device = device_type(opt.device)
    sizes = None if torchrun else world_sizes(opt.world_sizes)
    if device not in (None, "cpu") and sizes:
        count = devices.accelerator_count(device)
        if max(sizes) > count:
            raise UsageError(
                "--world-sizes",
                f"{max(sizes)} ranks need {max(sizes)} {device} devices, {count} available",
                f"pass world sizes up to {count}, or --device cpu",
            )
    return Options(
        impl_specs=impl_specs,
        world_sizes=sizes,
        device=device,
        backend=backend_name(opt.backend, device),
        check_timeout=seconds("--check-timeout", opt.check_timeout, allow_zero=False, example="60"),
        grace=seconds("--grace", opt.grace, allow_zero=True, example="5"),
        threads_per_rank=positive_int("--threads-per-rank", opt.threads_per_rank, example="1"),
        expectations_dir=existing_dir(
            "--expectations-dir", opt.expectations_dir, what="<impl>[.<device>].txt files"
        ),
        check_dirs=[check_dir(d, rootpath) for d in opt.check_dir],
        reports_dir=Path(opt.reports_dir) if writes_reports else None,
        shuffle=shuffle_seed(getattr(opt, "shuffle", None)),
        rank_memory=rank_memory(getattr(opt, "rank_memory_limit", None)),
    )


def oversubscription_warning(sizes: list[int], placement: dict) -> str | None:
    """A warning when CPU world sizes exceed the CPU count (ranks then share cores)."""
    cpus = os.cpu_count() or 1
    over = [ws for ws in sizes if placement[ws][0] == "cpu" and ws > cpus]
    if not over:
        return None
    return (
        f"fsdp conformance: WARNING world size {max(over)} on {cpus} CPU core(s): ranks share cores, "
        f"so expect those checks to take roughly {max(over) / cpus:.1f}x longer (and timeouts to "
        f"come closer); pass --world-sizes up to {cpus} or a larger --check-timeout if they time out"
    )
