"""Exceptions that front ends report to users as such (the Hydra app: one line, exit status 2)."""

from __future__ import annotations


class IncompatibleCheckpoint(ValueError):
    """A checkpoint's compression state cannot be resumed by this run (another format, delay
    settings or hierarchy, or state that cannot be re-sharded for another number of ranks): the
    user's choice of checkpoint or settings, which front ends report as such (the app: one line,
    exit status 2)."""
