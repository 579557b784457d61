"""kill -9 of the supervisor at random instants, then a restart on the same run directory (the CI
version: three kills; ``bench/faults.py`` runs the long one)."""

from __future__ import annotations

import random
from pathlib import Path

from e2e.faults import campaign


def test_kill_9_at_random_instants_then_restart(tmp_path: Path) -> None:
    seed = random.randrange(2**32)
    figures = campaign.run(tmp_path, kills=3, rng=random.Random(seed), steps=150)
    assert figures.problems == [], f"seed {seed}: {figures}"
    # Up to three kills: on a quiet machine the resumed run may finish before the last instant comes.
    assert figures.kills >= 1 and figures.corruptions == 0 and figures.duplicates == 0
