"""Scope: where variables' values live between runs (parameters, optimizer state)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fluidps.errors import ProgramError
from fluidps.ops.selected_rows import SelectedRows
from fluidps.ops.sparse_table import SparseTable

Value = np.ndarray | SelectedRows | SparseTable


def as_value(name: str, value: Any) -> Value:
    """Values are numpy arrays, SelectedRows or hashed tables; anything array-like is converted."""
    if isinstance(value, (np.ndarray, SelectedRows, SparseTable)):
        return value
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ProgramError(f"cannot store {type(value).__name__} as variable {name!r}: {e}") from None


class Scope:
    """A mapping of variable names to values, with an optional parent.

    Lookups (`scope[name]`, `name in scope`, `find`) fall back to the parent
    chain; assignments set the value in this scope. `new_scope()` makes a
    child whose own values disappear with it.
    """

    def __init__(self, parent: Scope | None = None):
        self.parent = parent
        self._vars: dict[str, Value] = {}

    def find(self, name: str) -> Value | None:
        """The value of `name` here or in the nearest ancestor holding it."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope._vars:
                return scope._vars[name]
            scope = scope.parent
        return None

    def owner(self, name: str) -> Scope | None:
        """The scope (this one or an ancestor) that holds `name`."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope._vars:
                return scope
            scope = scope.parent
        return None

    def __getitem__(self, name: str) -> Value:
        value = self.find(name)
        if value is None:
            raise KeyError(f"variable {name!r} is not in the scope")
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        self._vars[name] = as_value(name, value)

    def __delitem__(self, name: str) -> None:
        del self._vars[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        """Names held by this scope itself (not its ancestors)."""
        return iter(list(self._vars))

    def __len__(self) -> int:
        return len(self._vars)

    def new_scope(self) -> Scope:
        return Scope(self)

    def __repr__(self) -> str:
        parent = ", with parent" if self.parent is not None else ""
        return f"Scope({len(self._vars)} variables{parent})"
