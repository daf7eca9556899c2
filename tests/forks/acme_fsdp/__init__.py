"""Acme FSDP: an out-of-tree "fork" of upstream torch FSDP for the harness's own tests.

It is upstream ``torch.distributed.fsdp`` unchanged, under another package name (``acme_fsdp.fsdp``)
and other implementation names, installed the way a vendor's package is: by the entry points of
``acme_fsdp-0.1.dist-info`` (group ``fsdp_conformance.implementations``) once ``tests/forks`` is
on the import path (no pip install). ``tests/harness/test_forks.py`` runs it; see
:mod:`acme_fsdp.adapters` for what each entry point shows.
"""
