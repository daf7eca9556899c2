"""Part P of ``conformance/SPEC.md``: FSDP2's per-parameter sharding (``fully_shard``)."""
