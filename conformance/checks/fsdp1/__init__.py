"""FSDP1's runtime through the flat parameter (the FSDP1 halves of P5 and P6 in ``conformance/SPEC.md``)."""
