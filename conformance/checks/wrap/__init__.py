"""Part W of ``conformance/SPEC.md``: the FSDP1 auto-wrap utilities."""
