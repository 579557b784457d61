"""``python -m oomguard.supervisor``: kept for scripts written before ``python -m oomguard``."""

from __future__ import annotations

import sys

from oomguard.supervisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
