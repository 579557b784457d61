"""The spare pool's policy (decide/sparepool.py): how many spares to start, and when a reserve fits."""

from __future__ import annotations

from oomguard.supervisor.decide.sparepool import FREE_SHARE, FREE_SPARES, POOL, reserve_fits, spares_to_start

GIB = 1 << 30


def test_the_reserve_starts_with_the_first_spare_and_the_pool_stops_at_two() -> None:
    assert POOL == 2
    assert spares_to_start(waiting=0, importing=0, reserve=True, behind=True) == 2
    assert spares_to_start(waiting=0, importing=1, reserve=True, behind=True) == 1  # behind the one importing
    assert spares_to_start(waiting=1, importing=0, reserve=True, behind=True) == 1
    assert spares_to_start(waiting=1, importing=1, reserve=True, behind=True) == 0  # never a third
    assert spares_to_start(waiting=2, importing=0, reserve=True, behind=True) == 0
    assert spares_to_start(waiting=5, importing=0, reserve=True, behind=True) == 0


def test_where_a_spare_cannot_wait_behind_another_one_imports_at_a_time() -> None:
    assert spares_to_start(waiting=0, importing=0, reserve=True, behind=False) == 1
    assert spares_to_start(waiting=0, importing=1, reserve=True, behind=False) == 0
    assert spares_to_start(waiting=1, importing=0, reserve=True, behind=False) == 1
    assert spares_to_start(waiting=2, importing=0, reserve=True, behind=False) == 0


def test_without_a_reserve_only_the_next_attempts_spare() -> None:
    for behind in (True, False):
        assert spares_to_start(waiting=0, importing=0, reserve=False, behind=behind) == 1
        assert spares_to_start(waiting=1, importing=0, reserve=False, behind=behind) == 0
        assert spares_to_start(waiting=0, importing=1, reserve=False, behind=behind) == 0


def test_a_reserve_fits_while_a_quarter_of_the_host_and_four_spares_stay_available() -> None:
    total, spare = 24 * GIB, GIB // 2
    floor = FREE_SHARE * total
    assert reserve_fits(int(floor) + spare, total, spare)  # exactly the margin left after it
    assert not reserve_fits(int(floor) + spare - 1, total, spare)
    assert reserve_fits(20 * GIB, total, spare)
    # a small host: four spares' worth is the larger margin
    small, big = 8 * GIB, GIB
    assert FREE_SPARES * big > FREE_SHARE * small
    assert reserve_fits(5 * GIB, small, big) and not reserve_fits(5 * GIB - 1, small, big)
    assert not reserve_fits(3 * GIB, small, big)


# --- merged from tests/test_sparepool_pins.py ---------------------------------------------------------------
# Pins for decide/sparepool.py's constants, which mutmut 3 never mutates (docs/mutation.md).
#
# test_sparepool.py reads the host's share from ``FREE_SHARE`` itself, so any share passed it (those
# whose floor is not a whole byte failed only by ``int()`` truncating it): the quarter that
# docs/restart.md promises is pinned here in bytes.


MIB = 1 << 20


def test_a_reserve_leaves_a_quarter_of_the_host_in_bytes() -> None:
    # a 64 GiB host and a 512 MiB spare: the quarter (16 GiB) is the larger margin, four spares are 2 GiB
    total, spare = 64 * GIB, 512 * MIB
    assert reserve_fits(16 * GIB + spare, total, spare)
    assert not reserve_fits(16 * GIB + spare - 1, total, spare)
    # the project's 24 GiB box: 6 GiB must stay available after a reserve
    assert reserve_fits(6 * GIB + spare, 24 * GIB, spare)
    assert not reserve_fits(6 * GIB + spare - 1, 24 * GIB, spare)
