"""Errors every layer may raise."""


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2, on every rank."""
