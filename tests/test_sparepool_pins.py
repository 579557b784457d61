"""Pins for decide/sparepool.py's constants, which mutmut 3 never mutates (docs/mutation.md).

test_sparepool.py reads the host's share from ``FREE_SHARE`` itself, so any share passed it (those
whose floor is not a whole byte failed only by ``int()`` truncating it): the quarter that
docs/restart.md promises is pinned here in bytes.
"""

from __future__ import annotations

from oomguard.supervisor.decide.sparepool import reserve_fits

GIB = 1 << 30
MIB = 1 << 20


def test_a_reserve_leaves_a_quarter_of_the_host_in_bytes() -> None:
    # a 64 GiB host and a 512 MiB spare: the quarter (16 GiB) is the larger margin, four spares are 2 GiB
    total, spare = 64 * GIB, 512 * MIB
    assert reserve_fits(16 * GIB + spare, total, spare)
    assert not reserve_fits(16 * GIB + spare - 1, total, spare)
    # the project's 24 GiB box: 6 GiB must stay available after a reserve
    assert reserve_fits(6 * GIB + spare, 24 * GIB, spare)
    assert not reserve_fits(6 * GIB + spare - 1, 24 * GIB, spare)
