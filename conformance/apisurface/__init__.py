"""The public API surface of the torch under test and its coverage by the suite's checks.

* :mod:`.surface`: the entries, found by introspection of the imported torch;
* :mod:`.trace`: which entries each case calls or passes, from one traced run of the upstream
  adapters (the mutation campaign's trace mechanism, recording API calls instead of lines);
* :mod:`.report`: ``python -m conformance api-coverage`` (markdown / JSON), the snapshot.

Checked in beside them: ``coverage.json`` (the snapshot of the last traced run, so that the test
need not trace), ``out_of_scope.toml`` (entries no check can exercise here, each with a reason)
and ``uncovered.txt`` (the known uncovered entries: tests/harness/test_api_coverage.py requires it
to equal the uncovered set exactly). See docs/api-coverage.md.
"""
