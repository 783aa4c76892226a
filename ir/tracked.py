"""Containers and attributes that report their edits, so `Program.revision` sees every one.

The IR's `ops`, `vars` and `blocks` are `list` / `dict` subclasses: reads (indexing,
iteration, `len`, `in`) are the built-in C methods, untouched; only the mutating
methods are wrapped to call `on_change` afterwards. Copies made by slicing,
`.copy()` or `+` are plain lists and dicts, detached from the owner.
`TouchOnAssign` does the same for assigning the attributes of the IR objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

OnChange = Callable[[], None]


def _notifying(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def mutate(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            # Also when the call raised: an extend from a failing iterator or a sort
            # whose key raised may have changed the container part-way.
            self._on_change()

    return mutate


class TrackedList(list[T]):
    """A list that calls `on_change()` after every mutation."""

    __slots__ = ("_on_change",)

    def __init__(self, items: Iterable[T], on_change: OnChange):
        super().__init__(items)
        self._on_change = on_change

    # copy, deepcopy and pickle rebuild a tracked list reporting to (a copy of) its owner.
    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return type(self), (list(self), self._on_change)

    append = _notifying(list.append)
    extend = _notifying(list.extend)
    insert = _notifying(list.insert)
    remove = _notifying(list.remove)
    pop = _notifying(list.pop)
    clear = _notifying(list.clear)
    sort = _notifying(list.sort)
    reverse = _notifying(list.reverse)
    __setitem__ = _notifying(list.__setitem__)
    __delitem__ = _notifying(list.__delitem__)
    __iadd__ = _notifying(list.__iadd__)
    __imul__ = _notifying(list.__imul__)


class TrackedDict(dict[K, V]):
    """A dict that calls `on_change()` after every mutation."""

    __slots__ = ("_on_change",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]], on_change: OnChange):
        super().__init__(items)
        self._on_change = on_change

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return type(self), (dict(self), self._on_change)

    __setitem__ = _notifying(dict.__setitem__)
    __delitem__ = _notifying(dict.__delitem__)
    pop = _notifying(dict.pop)
    popitem = _notifying(dict.popitem)
    clear = _notifying(dict.clear)
    update = _notifying(dict.update)
    setdefault = _notifying(dict.setdefault)
    __ior__ = _notifying(dict.__ior__)


class TouchOnAssign:
    """Mixin: assigning a public attribute of a built object is an edit of its program.

    The class's `_touch()` reports it. Private attributes (`_extra`, caches) and the
    back-reference named by `_OWNER_ATTR` (moving an object is the edit of the
    container it moves between, which reports itself) do not count. `__init__` writes
    its fields into `__dict__` directly: building an object is no edit, and a touch
    per field would slow down building and parsing.
    """

    __slots__ = ()
    _OWNER_ATTR = ""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name[0] != "_" and name != self._OWNER_ATTR:
            self._touch()

    def _touch(self) -> None:
        raise NotImplementedError
