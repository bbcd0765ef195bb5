"""Numbers and switches in a deployment file must be written as numbers and switches.

pydantic's lax mode, right for strings from the environment, reads a file's ``port = true`` as port 1, a
``kv_capacity_blocks = true`` as one block and ``enabled = 1`` as on: a typo that starts a service doing
something else than the file says. A file is typed (TOML and YAML have numbers and booleans), so its values
are checked as written before pydantic coerces anything; a number written as a string is refused too, with
the fix in the message.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


class WrittenTypeError(ValueError):
    """A value of the wrong kind where the file's format has the right one; the message names its key."""


def check_written_types(model: type[BaseModel], data: object, root: str = "") -> None:
    """Raise :class:`WrittenTypeError` for the first value of ``data`` (a table for ``model``) that is a
    boolean or a string where a number is meant, or anything but a boolean where a switch is. The rest
    (unknown keys, ranges, strings) is pydantic's to report."""
    if not isinstance(data, Mapping):
        return
    for key, value in data.items():
        field = model.model_fields.get(str(key))
        if field is not None:
            _check(field.annotation, value, f"{root}.{key}" if root else str(key))


def _check(annotation: Any, value: object, where: str) -> None:
    if value is None:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:  # Optional[X]: X's rule
            _check(kinds[0], value, where)
    elif annotation is bool:
        if not isinstance(value, bool):
            raise WrittenTypeError(f"{where}: must be true or false, not {_shown(value)}")
    elif annotation is int or annotation is float:
        if isinstance(value, bool | str):
            kind = "a whole number" if annotation is int else "a number"
            raise WrittenTypeError(f"{where}: must be {kind}, not {_shown(value)}")
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        check_written_types(annotation, value, where)
    elif origin is list and isinstance(value, list) and args:
        for i, item in enumerate(value):
            _check(args[0], item, f"{where}.{i}")
    elif origin is dict and isinstance(value, Mapping) and len(args) == 2:
        for key, item in value.items():
            _check(args[1], item, f"{where}.{key}")


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        hint = " (write it without quotes)" if _is_number(value) else ""
        return f"the string {value!r}{hint}"
    return repr(value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
