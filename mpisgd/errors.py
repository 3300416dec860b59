"""Errors every layer may raise."""


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2, on every rank."""


class ModelOutputError(TypeError):
    """A model's forward returned something other than one array of scores (a PyTorch module's tuple or dict)."""
