"""`Name`: an enum whose members are strings — printed, hashed and compared as their values — so a
member and its name are one key in a dict, a checkpoint or a JSON file."""

from __future__ import annotations

import enum


class Name(str, enum.Enum):
    __str__ = str.__str__
    __hash__ = str.__hash__
