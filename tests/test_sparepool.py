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
