"""A torch mutant that cannot be swapped in by code: one module loaded from a private file.

[Note: the torch overlay]
A torch mutant at module or class level, in a decorator or a default, or one whose code swap the
ranks refuse (see :mod:`conformance.mutation.live`) is judged in a fresh conformance run in which
that one module of the installed torch is replaced: this directory goes on ``PYTHONPATH`` for the
run, so every interpreter of it (the driver and each rank's workers, which inherit the
environment) imports this ``sitecustomize`` at start-up, before anything imports torch. It puts a
finder first on ``sys.meta_path`` that answers for the module ``$FSDP_MUTATION_OVERLAY_MODULE``
only, loading it from ``$FSDP_MUTATION_OVERLAY_FILE`` (the mutant's text in the campaign's work
directory); a package keeps its installed directory as its search path, so its submodules load
from the installed torch. Nothing installed is written. Self-contained on purpose: it runs before
``sys.path`` holds the suite.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

MODULE_ENV = "FSDP_MUTATION_OVERLAY_MODULE"
FILE_ENV = "FSDP_MUTATION_OVERLAY_FILE"


class OverlayFinder:
    """Find ``module`` at ``file`` instead of where the other finders would."""

    def __init__(self, module: str, file: str):
        self.module, self.file = module, file

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        installed = importlib.machinery.PathFinder.find_spec(fullname, path)
        locations = installed.submodule_search_locations if installed is not None else None
        return importlib.util.spec_from_file_location(
            fullname, self.file, submodule_search_locations=locations
        )


if os.environ.get(MODULE_ENV) and os.environ.get(FILE_ENV):
    sys.meta_path.insert(0, OverlayFinder(os.environ[MODULE_ENV], os.environ[FILE_ENV]))
