"""Runs a command and records when it exited, for the restart split of bench/peers.py.

``python -I -S exit_stamp.py COMMAND...``: the moment the training process is reaped, as opposed
to when its last Python code ran (its ``exit`` record) or when the supervisor decided what to do
next (the journal), splits "the dying interpreter tears down" from "the supervisor notices and
decides". It ends the way the command ended (same code or the same signal) so the supervisor
classifies the real exit. Stdlib only and without site (-S): it adds a few milliseconds to the
interpreter-start segment, which counts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    child = subprocess.Popen(sys.argv[1:])
    code = child.wait()
    path = os.environ.get("PEERS_RECORDS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"ev": "reaped", "t": time.time(), "pid": child.pid}) + "\n")
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
