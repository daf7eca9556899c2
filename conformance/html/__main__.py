"""``python -m conformance.html RUN_DIR_OR_JSON... [-o page.html]``: the same as
``python -m conformance report``, without importing pytest (``nox -s report`` installs only Jinja2)."""

import sys

from conformance.html import main

sys.exit(main())
