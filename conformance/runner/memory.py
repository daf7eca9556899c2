"""The memory each rank may use (``--rank-memory-limit``), read from the driver.

[Note: rank memory limit]
A rank that allocates without bound would otherwise run until the kernel's OOM killer picks a
victim, on a shared machine perhaps another process. ``RLIMIT_AS`` cannot bound a torch process
(it reserves far more address space than it uses), so the driver watches instead: while it waits
for a check's results it reads every pending rank's resident set (``/proc/<pid>/statm``) every
:data:`POLL_S` seconds, and a rank above its limit is killed at once (with its process group) and
fails its check with ``rank 1 exceeded its 5.8 GiB memory limit in <case id>``; the group is then
restarted for the next check, as after any death. The default limit is the host's memory shared
among the ranks and the driver, ``MemTotal / (world size + 1)``. Limits: a rank can allocate
faster than the driver polls (it may go over by what it allocates in :data:`POLL_S`); the
processes a rank starts (the checkpoint save jobs) count separately, not against its limit; where
``/proc`` does not exist nothing is watched.
"""

from __future__ import annotations

import os
import re

POLL_S = 0.2  # seconds between two readings of the ranks' resident sets
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", re.I)
OFF = ("off", "none", "0")


def parse_size(text: str) -> int | None:
    """``"5.8G"``, ``"800M"``, ``"800MiB"``, ``"1073741824"`` as bytes (binary units); ``"off"``
    as None. Raises ValueError for anything else."""
    if str(text).strip().lower() in OFF:
        return None
    found = _SIZE.fullmatch(str(text))
    if found is None:
        raise ValueError(text)
    value = float(found.group(1)) * _UNITS[found.group(2).lower()]
    if value < 1:
        raise ValueError(text)
    return int(value)


def format_size(n: float) -> str:
    """Bytes as ``"5.8 GiB"`` / ``"640 MiB"`` / ``"12 KiB"``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def mem_total() -> int | None:
    """The host's memory in bytes (``/proc/meminfo``'s MemTotal), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_limit(world_size: int) -> int | None:
    """``MemTotal / (world_size + 1)``: the ranks and the driver share the host."""
    total = mem_total()
    return None if total is None else total // (world_size + 1)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident(pid: int) -> int | None:
    """Process ``pid``'s resident set in bytes, None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
