"""``--edit FILE:KEY=VALUE``: the batch sizes of scripts that read them from a config file.

Each attempt gets a copy of FILE in the run directory with the keys set (dotted keys reach into
nested tables, placeholders in VALUE are filled), and the command's argument that names FILE is
pointed at the copy. The user's file is only ever read. YAML keeps its comments, order and quoting
(ruamel.yaml's round-trip mode), TOML its comments and layout (tomlkit); JSON keeps key order.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.supervisor.command.placeholders import render
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.record.journal import write_atomic

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}


@dataclass(frozen=True)
class Edit:
    file: str  # as the user wrote it (and as the command names it)
    key: str  # dotted: train.micro_batch_size
    value: str  # may hold placeholders

    @property
    def keys(self) -> list[str]:
        return self.key.split(".")


def parse_edit(spec: str) -> Edit:
    """``FILE:KEY=VALUE``; the value may itself hold ``:`` and ``=``."""
    head, eq, value = spec.partition("=")
    file, colon, key = head.rpartition(":")
    if not eq or not colon or not file or not key or any(not k for k in key.split(".")):
        raise UsageError("--edit", f"{spec!r} is not FILE:KEY=VALUE",
                         "e.g. --edit 'configs/x.yaml:train.micro_batch_size={micro_batch}'")
    if Path(file).suffix.lower() not in FORMATS:
        raise UsageError("--edit", f"{file} is not a .yaml, .yml, .json or .toml file", "edit one of those")
    return Edit(file, key, value)


# --- reading and writing the three formats ---------------------------------------------------------


def _yaml() -> Any:
    """ruamel.yaml in round-trip mode: comments (at their columns), key order and quotes survive."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    return yaml


def _load(path: Path) -> Any:
    text = path.read_text()
    kind = FORMATS[path.suffix.lower()]
    if kind == "yaml":
        return _yaml().load(text)
    if kind == "toml":
        import tomlkit

        return tomlkit.parse(text)
    return json.loads(text)


def _dump(doc: Any, path: Path) -> str:
    kind = FORMATS[path.suffix.lower()]
    if kind == "yaml":
        out = io.StringIO()
        _yaml().dump(doc, out)
        return out.getvalue()
    if kind == "toml":
        import tomlkit

        return tomlkit.dumps(doc)
    return json.dumps(doc, indent=2) + "\n"


def load_checked(path: Path, option_spec: str) -> Any:
    """The parsed file, or one line (exit 2) when it cannot be read or parsed."""
    try:
        return _load(path)
    except OSError as exc:
        raise UsageError("--edit", f"cannot read {path}: {exc.strerror}", "check the path in " + option_spec) from None
    except Exception as exc:  # each parser has its own error types; all mean "does not parse"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError("--edit", f"{path} does not parse ({first})", "fix the file") from None


def _parent(doc: Any, edit: Edit) -> tuple[Any, Any]:
    """The container holding the edited key, and the key (an int for a list index)."""
    node = doc
    parts = edit.keys
    for depth, part in enumerate(parts):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            key: Any = int(part)
        elif isinstance(node, Mapping) and part in node:
            key = part
        else:
            where = ".".join(parts[:depth + 1])
            raise UsageError("--edit", f"{edit.file} has no key {where!r}",
                             "check the key (dotted for nesting, e.g. train.micro_batch_size)")
        if depth == len(parts) - 1:
            return node, key
        node = node[key]
    raise UsageError("--edit", f"empty key in {edit.file}", "give a key")


def _typed(text: str, current: Any) -> Any:
    """VALUE as the file should hold it: a number, true/false or null where it reads as one (JSON
    syntax), but a string where the file had a string."""
    if isinstance(current, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- what the loop calls -----------------------------------------------------------------------------


def check_edits(specs: Sequence[str], command: Sequence[str], cwd: Path) -> list[Edit]:
    """At start: every spec well-formed, every file readable and parsed, every key present, and
    the command names every file (else the copy could not be handed over)."""
    edits = [parse_edit(spec) for spec in specs]
    for edit, spec in zip(edits, specs, strict=True):
        path = cwd / edit.file
        _parent(load_checked(path, spec), edit)
        if not any(_names(token, path, cwd) is not None for token in command):
            raise UsageError("--edit", f"no argument of the command names {edit.file}",
                             f"pass the file to the script, e.g. --config {edit.file}")
    return edits


def _names(token: str, path: Path, cwd: Path) -> str | None:
    """The prefix before the file name when ``token`` names ``path``: ``""`` for ``cfg.yaml``,
    ``"--config="`` for ``--config=cfg.yaml``; None when it does not name it."""
    splits = [("", token)] + [(token[:i + 1], token[i + 1:]) for i, c in enumerate(token) if c == "="]
    for prefix, rest in splits:
        if rest and _same(cwd / rest, path):
            return prefix
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def apply_edits(edits: Sequence[Edit], argv: Sequence[str], values: Mapping[str, object], cwd: Path,
                out_dir: Path) -> list[str]:
    """Write this attempt's copies under ``out_dir`` and return the argv pointed at them."""
    by_file: dict[str, list[Edit]] = {}
    for edit in edits:
        by_file.setdefault(edit.file, []).append(edit)
    result = list(argv)
    for file, group in by_file.items():
        path = cwd / file
        doc = _load(path)
        for edit in group:
            node, key = _parent(doc, edit)
            node[key] = _typed(render(edit.value, values), node[key])
        copy = write_atomic(out_dir / path.name, _dump(doc, path))  # a worker that starts reads a whole file
        result = [(prefix + str(copy)) if (prefix := _names(t, path, cwd)) is not None else t for t in result]
    return result
