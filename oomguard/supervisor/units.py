"""Sizes in bytes, read and written one way everywhere (stdlib only): ``512M``/``1.5GiB`` in, ``1.5 GiB`` out.

Tested through the options and figures it reads and writes: tests/unit/supervisor/test_config.py.
"""

from __future__ import annotations

import re

MIB = 1024**2
GIB = 1024**3

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``512M``, ``1.5GiB``, ``2GB`` or ``1048576`` (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size")
    number, unit, _ = match.groups()
    value = int(float(number) * 1024 ** _POWERS[unit.lower()])
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def format_size(n: float) -> str:
    """``1.5 GiB``, ``300.0 MiB``, ``512 B``: one decimal from KiB up, binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
