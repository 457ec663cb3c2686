"""Each strategy's options as one frozen dataclass (`Options` in the strategy's module), validated
once where it is made.

A strategy's `solve(graph, budget_bytes, **options)` names exactly the fields of its `Options`
(tests/test_strategy_options.py checks the two agree), so a misspelt option is a TypeError when
`solve` is called directly; `remat.solve`, `remat.optimize` and the CLI make the `Options` first
(`Options.make(strategy, kwargs)`), which names the strategy's options in its OptionsError and
checks each value's type and range before any work.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from remat.core.errors import RematError

__all__ = ["OptionsError", "StrategyOptions", "check_int", "check_choice", "check_number"]


class OptionsError(RematError, ValueError):
    """A strategy option of an unknown name, or a value of the wrong type or range."""


@dataclass(frozen=True)
class StrategyOptions:
    """The base of every strategy's `Options`: no fields of its own."""

    @classmethod
    def make(cls, strategy: str, kwargs: dict[str, Any]) -> "StrategyOptions":
        """The options `kwargs` name, checked: OptionsError for a name `strategy` does not take."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise OptionsError(f"solver {strategy!r} takes no option {', '.join(unknown)} "
                               f"(its options: {', '.join(names) or 'none'})")
        return cls(**kwargs)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as `solve`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """`value` is an int >= minimum (or None where `optional`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionsError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
    if value < minimum:
        raise OptionsError(f"{name} must be >= {minimum}, got {value}")


def check_number(name: str, value: Any, minimum: float, optional: bool = False, strict: bool = False) -> None:
    """`value` is a real number >= minimum (> where `strict`), or None where `optional`."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise OptionsError(f"{name} must be a number{' or None' if optional else ''}, got {value!r}")
    if value < minimum or strict and value == minimum:
        raise OptionsError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """`value` is one of `choices`, of the same type (1 is not True, nor True 1)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise OptionsError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
