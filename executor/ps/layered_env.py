"""The environment of a pserver block running on a worker thread."""

from __future__ import annotations

from typing import Any


class LayeredEnv:
    """Writes to `shared` names go to the shared environment, every other write stays
    local, so concurrent blocks do not see each other's temporaries."""

    def __init__(self, shared: dict[str, Any], shared_names: set[str]):
        self._shared = shared
        self._names = shared_names
        self._local: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        return self._local[name] if name in self._local else self._shared[name]

    def __setitem__(self, name: str, value: Any) -> None:
        (self._shared if name in self._names else self._local)[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self._local or name in self._shared

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default
