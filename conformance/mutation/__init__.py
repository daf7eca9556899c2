"""A machine-generated mutation campaign on the reference (``python -m conformance mutation``,
``nox -s mutation``): cosmic-ray's operators mutate ``reference/`` in a private copy of the tree,
the conformance cases that execute each mutated statement run against it, and the survivors are
triaged in ``triage.toml``. See :mod:`.run` for the campaign, :mod:`.coverage` for the check
selection, :mod:`.operators` for the operator set and :mod:`.report` for the score."""
