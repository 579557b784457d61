"""kill -9 of the supervisor at random instants, then a restart on the same run directory (the CI
version: three kills; ``bench/faults.py`` runs the long one)."""

from __future__ import annotations

import random
from pathlib import Path

from faults import campaign


def test_kill_9_at_random_instants_then_restart(tmp_path: Path) -> None:
    seed = random.randrange(2**32)
    figures = campaign.run(tmp_path, kills=3, rng=random.Random(seed), steps=100)
    assert figures.problems == [], f"seed {seed}: {figures}"
    assert figures.kills == 3 and figures.corruptions == 0 and figures.duplicates == 0
