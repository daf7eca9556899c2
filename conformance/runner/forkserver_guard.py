"""Imported first by every forkserver the harness starts (see :func:`lifeline.forkserver_context`):
the server then dies with the process that started it, also while it is still importing torch for
its children (seconds), which its own exit-on-EOF check only covers once that import is done."""

import os

from conformance.runner import lifeline

lifeline.die_with_parent(int(os.environ[lifeline.STARTER_ENV]))
