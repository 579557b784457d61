"""How many spare interpreters to keep (run/spare.py): the next attempt's, and a reserve for the one after.

One spare, started when an attempt starts, is ready for the next attempt only if that attempt lives
longer than the spare's imports. An attempt that itself started from a spare reaches its OOM within
seconds (its imports are done), so after back-to-back OOMs the next worker waited for a spare still
importing (docs/restart.md: the second restart at 0.66-0.88 of cold against 0.34-0.48 for the first).
The reserve is a second spare, started with the first (below it in priority): by the time an
attempt from a spare ends, the reserve has had the whole of the attempt before to import in.

- At most ``POOL`` spares. The reserve starts as soon as it is allowed; while the spare before it
  is still importing it runs at nice 19 (``run/spare.RESERVE_NICE``) behind that one's 10, so on a
  machine with cores to spare both import at once, and on a busy one the reserve takes only the CPU
  time nobody else wants until the first has imported, then goes up to nice 10: the next attempt's
  spare is not slowed by it, nor is the running attempt. Where a spare's priority could not be
  raised back (not root, RLIMIT_NICE) spares start at the worker's priority, and then one imports
  at a time.
- The reserve holds host memory (an idle interpreter with torch: hundreds of MB) that the worker
  might need. It is started only while the host keeps ``FREE_SHARE`` of its memory, and at least
  ``FREE_SPARES`` times a spare's size, available after it; held while that stays true. Below it, the
  reserve is dropped and not started again in that run: a run that came that close to its host's
  memory once will again, and a spare started and killed in turn would only take CPU. The next
  attempt's own spare keeps the rules it always had (docs/restart.md).

Pure: the loop's spare keeper (``run/spare.Spares``) brings the counts and the host's figures.
"""

from __future__ import annotations

POOL = 2  # the next attempt's spare and a reserve for the attempt after it
FREE_SHARE = 0.25  # of the host's memory, available after the reserve
FREE_SPARES = 4  # and at least this many spares' worth


def reserve_fits(available: int, total: int, spare_bytes: int) -> bool:
    """Does the host keep enough memory available beside one more idle interpreter of ``spare_bytes``?
    To ask whether to keep a reserve that already holds its memory, add its bytes to ``available``."""
    return available - spare_bytes >= max(FREE_SHARE * total, FREE_SPARES * spare_bytes)


def spares_to_start(waiting: int, importing: int, reserve: bool, behind: bool) -> int:
    """How many spares to start now: ``waiting`` have imported, ``importing`` have not yet; a
    ``reserve`` is allowed (the host has room, the run has not dropped it); ``behind``: a spare
    can import behind another at a lower priority (its priority can be raised later); if not,
    one imports at a time."""
    room = (POOL if reserve else 1) - waiting - importing
    if room <= 0:
        return 0
    return room if behind else (1 if importing == 0 else 0)
