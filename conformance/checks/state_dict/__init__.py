"""Part S of ``conformance/SPEC.md``: the FSDP1 state dicts (FULL, SHARDED, LOCAL) and the
checkpoint flows built on them."""
