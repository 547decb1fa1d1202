"""Exceptions that front ends report to users as such (the Hydra app: one line, exit status 2)."""

from __future__ import annotations


class IncompatibleCheckpoint(ValueError):
    """A checkpoint's compression state cannot be resumed by this run (another number of ranks,
    format, delay settings or hierarchy): the user's choice of checkpoint or settings, which front
    ends report as such (the app: one line, exit status 2)."""
