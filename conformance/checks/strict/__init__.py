"""Part X of ``conformance/SPEC.md``: this project's strict rules (area ``strict``)."""
