"""Loader of the compiled CPU decode kernel (not built yet: the torch path is used)."""

from __future__ import annotations


def get():
    """The kernel object, or ``None`` when unavailable."""
    return None
