"""Each part of the reference stays no larger than its upstream counterpart, counted in code lines
the way ``tools/codelines.py`` counts them (no docstrings, ``[Note]`` blocks, comments or blank
lines): ``reference/_fully_shard`` against torch's ``fsdp/_fully_shard``, ``reference/wrap``
against ``fsdp/wrap.py`` + ``fsdp/_wrap_utils.py``, ``reference/_fsdp1`` against the rest of
``torch/distributed/fsdp/*.py``. Upstream's side is read from the torch under test."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WRAP_FILES = ("wrap.py", "_wrap_utils.py")


def _code_lines():
    spec = importlib.util.spec_from_file_location("codelines", ROOT / "tools" / "codelines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("codelines", module)
    spec.loader.exec_module(module)
    return module.code_lines


def _count(files) -> int:
    count = _code_lines()
    return sum(count(Path(f).read_text()) for f in files)


UPSTREAM = Path(os.path.dirname(torch.__file__)) / "distributed" / "fsdp"
PARTS = {
    "fsdp2": (
        ROOT / "reference" / "_fully_shard",
        lambda: (UPSTREAM / "_fully_shard").glob("*.py"),
    ),
    "wrap": (ROOT / "reference" / "wrap", lambda: (UPSTREAM / f for f in WRAP_FILES)),
    "fsdp1": (
        ROOT / "reference" / "_fsdp1",
        lambda: (p for p in UPSTREAM.glob("*.py") if p.name not in WRAP_FILES),
    ),
}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_is_no_larger_than_upstreams(part):
    ours, theirs = PARTS[part]
    mine = _count(ours.rglob("*.py"))
    upstream = _count(theirs())
    assert upstream > 0, f"no upstream files found for {part} under {UPSTREAM}"
    assert mine <= upstream, (
        f"reference part {part} has {mine} code lines, upstream's counterpart {upstream}: "
        "shorten it (python tools/codelines.py lists the files)"
    )
