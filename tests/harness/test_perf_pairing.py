"""perf/'s paired cases (an FSDP2-style implementation next to upstream in one task) pair every
implementation whose API is not upstream's own module: declared data (``ns``), not names."""

from __future__ import annotations

from conformance.adapters import FullyShardAdapter
from perf.conftest import is_upstream


def test_pairing_follows_the_namespace_not_the_name():
    assert is_upstream(FullyShardAdapter("torch.distributed.fsdp", name="renamed-upstream"))
    assert not is_upstream(FullyShardAdapter("reference", name="torch-fsdp2"))
