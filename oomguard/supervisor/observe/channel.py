"""Reading the structured records a worker appends to its events file (see worker/protocol.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomguard.worker import protocol


class ChannelReader:
    """Tails one attempt's events file; a torn last line waits for the rest of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = [protocol.decode(line.decode("utf-8", "replace")) for line in lines if line.strip()]
        return [r for r in records if r is not None]
