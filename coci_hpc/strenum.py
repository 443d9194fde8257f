"""The base of the package's string-valued enums (event values, leaf kinds): members are their
strings, so a JSON line, an HDF5 attribute or an f-string holds exactly the value, and a member
compares equal to the plain string that older files hold.

Python 3.11's ``enum.StrEnum`` does this; the package supports 3.10, which lacks it, so it is
defined here once (``str()`` and ``format()`` give the value on every version).
"""
from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A string enum whose ``str()``/``format()`` is its value (``enum.StrEnum``'s behaviour)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
