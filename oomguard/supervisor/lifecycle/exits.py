"""How ``oomguard run`` ends, as its exit status: what a service manager (the generated systemd unit,
a Slurm requeue, a shell loop) needs to tell a stop from a give-up from a crash. Stdlib only.

=====  ==========================================================  =============================
 code   meaning                                                     restart?
=====  ==========================================================  =============================
 0      the worker finished                                         no: done
 1      the policy gave up (a crash loop, does not fit at 1)        no: it would give up again
 2      a bad option or config value, found at start                no: every start finds it
 3      an error no restart can fix (ImportError before step 1)     no
 70     oomguard's own unexpected error (EX_SOFTWARE, cli.py)       yes: a fresh start may pass it
 75     a peer node was lost (EX_TEMPFAIL, distributed/)            yes: once every node is back
 130    stopped by SIGINT (Ctrl-C)                                  no: the operator's stop
 143    stopped by SIGTERM (systemctl stop, oomguard stop)          no: the operator's stop
=====  ==========================================================  =============================
"""

from __future__ import annotations

import signal

EXIT_FINISHED = 0
EXIT_GAVE_UP = 1  # run/loop.py's _dispatch, when the policy's decision is not to restart
EXIT_USAGE = 2
EXIT_UNFIXABLE = 3
EXIT_CRASHED = 70
EXIT_PEER_LOST = 75  # raised as PeerLost in distributed/coordination.py, returned by run/loop.py

NO_RESTART = (EXIT_GAVE_UP, EXIT_USAGE, EXIT_UNFIXABLE)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # run/control.py's stop handlers
STOPPED = tuple(128 + sig for sig in STOP_SIGNALS)  # the loop's _stopped returns 128 + the signal
