"""A worker that dies of the corpus's out-of-memory messages, one per attempt (tests/data/oom_corpus.jsonl).

Attempt N prints record N-1's output to stderr as the end of a traceback and exits 1, as a script
that raised it would; the attempt after the last record finishes. One ``oomguard run`` session so
walks the whole corpus, and the test reads how each attempt was classified and what was decided.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "data" / "oom_corpus.jsonl"


def main() -> int:
    records = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    attempt = int(os.environ["OOMGUARD_ATTEMPT"])
    print(f"worker attempt={attempt} micro={os.environ['OOMGUARD_MICRO_BATCH']}", flush=True)
    if attempt > len(records):
        return 0
    record = records[attempt - 1]
    lines = ["Traceback (most recent call last):", '  File "train.py", line 42, in <module>', "    train_step(batch)",
             '  File "train.py", line 17, in train_step', "    loss = model(batch).sum()", *record["output"]]
    sys.stderr.write("\n".join(lines) + "\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
