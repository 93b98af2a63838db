"""Fast construction of model nodes from parts the front end has already checked.

`model_construct` skips validation but still resolves every default per call
(pydantic 2.13 inspects each default factory's signature every time) and
handles aliases; a large machine has thousands of nodes. `make` fills the
same `__dict__` directly for plain models (no aliases, private attributes or
post-init hooks) and falls back to `model_construct` for any other.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_REQUIRED = None


@functools.cache
def _plan(cls) -> tuple[tuple[str, Callable[[], Any] | None], ...] | None:
    """(field, default maker or None when required) in field order; None when `cls` is not plain."""
    plain = not cls.__private_attributes__ and not cls.__pydantic_post_init__ and not cls.__pydantic_root_model__
    plain = plain and all(f.alias is None and f.validation_alias is None for f in cls.model_fields.values())
    if not plain:
        return None
    return tuple(
        (name, _REQUIRED if field.is_required() else field.default_factory or (lambda value=field.default: value))
        for name, field in cls.model_fields.items()
    )


def make(cls, **values):
    """`cls.model_construct(**values)`, fast: the values are trusted, defaults are filled here."""
    plan = _plan(cls)
    if plan is None:
        return cls.model_construct(**values)
    fields = {}
    for name, default in plan:
        if name in values:
            fields[name] = values[name]
        elif default is not _REQUIRED:
            fields[name] = default()
    node = cls.__new__(cls)
    object.__setattr__(node, "__dict__", fields)
    object.__setattr__(node, "__pydantic_fields_set__", set(values))
    object.__setattr__(node, "__pydantic_extra__", None)
    object.__setattr__(node, "__pydantic_private__", None)
    return node
