"""The program a command runs behind the wrappers that only set its limits, priority or placement.

``prlimit --as=1250000000 python train.py``, ``env A=1 python train.py``, ``nice -n 5 ...``,
``taskset -c 0-3 ...``, ``numactl --cpunodebind=0 ...``, ``timeout 2h ...`` and ``bash -c "python
train.py"`` all run ``python train.py`` in a process of the worker's tree, where the probe loads
(it is on the PYTHONPATH every process inherits). ``unwrap`` returns that inner command, for what is
judged from the program the command runs (is it Python, which script). Pure: words in, words out.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

SHELLS = frozenset({"sh", "bash", "dash", "zsh"})
# Each wrapper, and its options that take the next word as their value (``-n 5``); ``--opt=value``
# and flags are one word. ``positional``: the words the wrapper itself takes before the command
# (taskset's mask, timeout's duration, chrt's priority).
_VALUED = {
    "env": {"-u", "--unset", "-C", "--chdir"},
    "nice": {"-n", "--adjustment"},
    "prlimit": {"-o", "--output"},
    "taskset": set(),
    "numactl": {"-C", "-N", "-m", "-i", "-p", "-P", "-w", "--cpunodebind", "--membind", "--physcpubind",
                "--interleave", "--preferred", "--preferred-many", "--weighted-interleave"},
    "ionice": {"-c", "--class", "-n", "--classdata"},
    "chrt": {"-T", "--sched-runtime", "-P", "--sched-period", "-D", "--sched-deadline"},
    "stdbuf": {"-i", "-o", "-e", "--input", "--output", "--error"},
    "timeout": {"-s", "--signal", "-k", "--kill-after"},
    "time": {"-f", "--format", "-o", "--output"},
    "nohup": set(), "setsid": set(), "exec": set(), "command": set(),
}
_POSITIONAL = {"taskset": 1, "timeout": 1, "chrt": 1}
# Options that make the wrapper act on another process (``prlimit --pid 42``): no command follows.
_OTHER_PROCESS = {"-p", "--pid"}
_SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})


def unwrap(command: Sequence[str]) -> list[str]:
    """The command the wrappers run (the command itself when it has none); ``bash -c "..."`` is the
    last command of its string (``cd x && python train.py``). Unchanged where it cannot be told."""
    words = list(command)
    for _ in range(16):  # wrappers nest (``nice -n 5 prlimit --as=... python``); a bound, not a budget
        inner = _one_level(words)
        if inner is None or not inner:
            return words
        words = inner
    return words


def _one_level(words: list[str]) -> list[str] | None:
    """The words one wrapper runs, or None when ``words`` starts with no wrapper."""
    if not words:
        return None
    name = os.path.basename(words[0])
    if name in SHELLS:
        return _shell_string(words[1:])
    if name not in _VALUED:
        return None
    valued, wanted = _VALUED[name], _POSITIONAL.get(name, 0)
    i = 1
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[i + 1:]
        if name in ("prlimit", "taskset", "chrt", "ionice") and word.split("=")[0] in _OTHER_PROCESS:
            return None
        if name == "env" and "=" in word and not word.startswith("-"):
            i += 1  # NAME=value
        elif word.startswith("-") and word != "-":
            i += 2 if word in valued else 1
        elif wanted:
            wanted, i = wanted - 1, i + 1
        else:
            return words[i:]
    return None


def _shell_string(args: list[str]) -> list[str] | None:
    """``-c "string"``: the last command of the string; a script file or an interactive shell: None."""
    if len(args) < 2 or args[0] != "-c":
        return None
    try:
        words = shlex.split(args[1])
    except ValueError:  # an unbalanced quote: the shell will say so
        return None
    last: list[str] = []
    for word in words:
        last = [] if word in _SHELL_OPERATORS else [*last, word]
    return last or None
