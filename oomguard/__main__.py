"""``python -m oomguard``: the same command line as ``oomguard``."""

from __future__ import annotations

import sys

from oomguard.supervisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
