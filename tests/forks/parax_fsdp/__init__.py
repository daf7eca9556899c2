"""Parax FSDP: a small DTensor-based per-parameter FSDP for the harness's own tests.

Not a fork of upstream: its own design (:mod:`parax_fsdp.fsdp`), all-gathering through
parametrizations and reduce-scattering through functional collectives, so it takes paths the
upstream forks never take. Installed like a vendor's package, by the entry point of
``parax_fsdp-0.1.dist-info`` once ``tests/forks`` is on the import path; its known deviations are
in ``parax_fsdp/expectations/parax-fsdp.txt`` (passed with ``--expectations-dir``).
``tests/harness/test_forks.py`` runs it.
"""
