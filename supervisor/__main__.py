from __future__ import annotations

import sys

from supervisor.cli import main

sys.exit(main())
