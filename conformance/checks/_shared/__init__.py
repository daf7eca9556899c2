"""Models and helpers that checks of more than one spec part use (no checks here)."""
