"""Secret-looking arguments and environment values, hidden from what the dashboard serves.

The dashboard shows the training command and streams the worker's log; on a shared machine or a
network bind, ``--api-key sk-...`` or ``HF_TOKEN=...`` in either would be read by whoever can reach
it. ``argv`` hides the value after (or in) a secret-looking option and in ``NAME=value`` words with a
secret-looking name; ``text`` does the same inside free text (log lines).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

HIDDEN = "***"
# Names that hold secrets by convention: API_KEY, HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, --secret ...
# A name ending in key/token/auth/credential(s)/passphrase (not --tokenizer), or holding secret/password.
_SECRET_NAME = r"[A-Za-z0-9_.-]*(?:key|token|auth|credentials?|passphrase|(?:secret|passw(?:or)?d)[A-Za-z0-9_.-]*)"
_OPTION = re.compile(rf"^--?{_SECRET_NAME}$", re.IGNORECASE)
_OPTION_EQ = re.compile(rf"^(--?{_SECRET_NAME}=)(.+)$", re.IGNORECASE)
_ASSIGN = re.compile(rf"^({_SECRET_NAME}=)(.+)$", re.IGNORECASE)
# Environment-style NAME=value (upper case): the word anywhere in the name, e.g. AWS_ACCESS_KEY_ID.
_ENV_NAME = r"[A-Z0-9_]*(?:KEY|TOKEN|SECRET|PASSW(?:OR)?D|CREDENTIAL|AUTH)[A-Z0-9_]*"
_ENV = re.compile(rf"^({_ENV_NAME}=)(.+)$")
_ENV_IN_TEXT = re.compile(rf"(\b{_ENV_NAME}=)(\"[^\"]*\"|'[^']*'|[^\s;,&]+)")
_IN_TEXT = re.compile(rf"((?:--?{_SECRET_NAME}(?:=|\s+))|(?:\b{_SECRET_NAME}(?:=|:\s*)))(\"[^\"]*\"|'[^']*'|[^\s;,&]+)",
                      re.IGNORECASE)


def argv(words: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for word in words:
        if hide_next and not word.startswith("-"):
            out.append(HIDDEN)
            hide_next = False
            continue
        hide_next = bool(_OPTION.match(word))
        match = _OPTION_EQ.match(word) or _ASSIGN.match(word) or _ENV.match(word)
        out.append(match.group(1) + HIDDEN if match else text(word))  # text(): a script in one word
    return out


def text(line: str) -> str:
    if _IN_TEXT.search(line):
        line = _IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, line)
    if _ENV_IN_TEXT.search(line):
        line = _ENV_IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, line)
    return line


def status(doc: dict[str, Any]) -> dict[str, Any]:
    if isinstance(doc.get("command"), list):
        doc = {**doc, "command": argv(doc["command"])}
    return doc
