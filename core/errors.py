"""The bases of every error and warning remat raises: catch `RematError` to catch any of remat's own
errors, filter `RematWarning` to silence its warnings. Each error keeps the builtin base it had
(ValueError, TypeError, RuntimeError) so code that caught those still does; each is defined beside
the stage that raises it (or in core when several stages do)."""
from __future__ import annotations

__all__ = ["RematError", "RematWarning"]


class RematError(Exception):
    """An error of remat's own: the message says what is wrong and what to do."""


class RematWarning(UserWarning):
    """A warning of remat's own: what it did, or what the budget does not cover."""
