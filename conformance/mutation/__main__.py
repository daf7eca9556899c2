"""``python -m conformance.mutation [options]``: the campaign (see :mod:`conformance.mutation.run`)."""

import sys

from conformance.mutation.run import main

if __name__ == "__main__":
    sys.exit(main())
