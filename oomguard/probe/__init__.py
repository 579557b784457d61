"""oomguard's probe: evidence from inside every Python process of a supervised worker (docs/probe.md).

The supervisor puts ``site/`` first on the worker's ``PYTHONPATH``. Its ``sitecustomize`` loads this
package under a private name (so another ``oomguard`` on the worker's path is never shadowed nor
used) and starts it; once the program has imported torch, the probe counts optimizer steps, reads
the allocator's peaks and OOMs, and appends records to the channel (``common.protocol``).

Nothing here imports torch or the supervisor: torch is only touched once the program imported it.
"""

from __future__ import annotations

import os

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
