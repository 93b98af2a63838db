"""Fast construction of model nodes from parts the front end has already checked."""

from __future__ import annotations

import functools
from typing import Any, Callable


@functools.cache
def _defaults(cls) -> dict[str, Callable[[], Any]]:
    """Per model class, a maker of each optional field's default."""
    return {
        name: field.default_factory or (lambda value=field.default: value)
        for name, field in cls.model_fields.items()
        if not field.is_required()
    }


def make(cls, **values):
    """`cls.model_construct(**values)` without pydantic's per-call default resolution.

    The model is built from checked parts, so validation is skipped; filling the
    defaults here avoids pydantic inspecting every default factory on every node,
    which dominated loading a large machine.
    """
    given = set(values)
    for name, default in _defaults(cls).items():
        if name not in values:
            values[name] = default()
    return cls.model_construct(_fields_set=given, **values)
