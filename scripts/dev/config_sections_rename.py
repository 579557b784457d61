"""Rewrite ``config.<option>`` to ``config.<section>.<field>`` wherever the value is a ``RunConfig`` (issue 36.4).

    .venv/bin/python scripts/dev/config_sections_rename.py            # oomguard/, tests/, scripts/
    .venv/bin/python scripts/dev/config_sections_rename.py PATH...    # those files or folders only
    .venv/bin/python scripts/dev/config_sections_rename.py --check    # list what it would change; exit 1 if any

RunConfig's options moved into sections (``config.micro_batch`` -> ``config.batch.micro_batch``,
``config.checkpoints`` -> ``config.checkpoints.globs``, ``config.checkpoint_signal`` ->
``config.checkpoints.signal``); their flat names (TOML keys, journal keys) did not change, so this
reads the mapping from ``oomguard.supervisor.config.options()`` itself. It type-checks the files with
mypy's API and rewrites only attribute reads whose object mypy types as RunConfig (``config``,
``self.config``, ``supervisor.config``, ``cfg``...): an ``args.micro_batch`` or a ``plan.micro_batch``
is left alone. Where an old name is now a section (``checkpoints``, ``web``, ``notify``), a use already
followed by one of the section's fields (``config.web.port``) is the new form and is kept, so running it
twice changes nothing. A call ``RunConfig(micro_batch=...)`` becomes ``RunConfig.of(micro_batch=...)``.
What it cannot rewrite (an attribute of an untyped ``config``, a ``config=SimpleNamespace(notify=...)``
stand-in in a test) it lists for a hand edit; mypy
(on oomguard/) names any use left, ``dataclasses.replace(config, grow=True)`` included.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import sys
import tokenize
from collections.abc import Iterator, Mapping
from pathlib import Path

from mypy import build
from mypy.modulefinder import BuildSource
from mypy.nodes import Expression, MemberExpr, MypyFile, NameExpr, RefExpr
from mypy.options import Options
from mypy.traverser import NameAndMemberCollector
from mypy.types import AnyType, Instance, Type, UnionType, get_proper_type

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from oomguard.supervisor import config as config_module  # noqa: E402  (after the path, for a bare checkout)

RUN_CONFIG = "oomguard.supervisor.config.RunConfig"
WIDTH = 120  # ruff's line-length


def mapping() -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    """(old flat name -> new dotted path, section -> its fields). A flat name that is still an attribute
    of RunConfig in its own right (``world_size``: torchrun's shape, else the option) is not renamed."""
    renames: dict[str, str] = {}
    fields: dict[str, frozenset[str]] = {}
    for option in config_module.options():
        if option.section is None:
            continue
        fields.setdefault(option.section, frozenset())
        fields[option.section] |= {option.field.name}
        if isinstance(getattr(config_module.RunConfig, option.name, None), property):
            continue
        renames[option.name] = f"{option.section}.{option.field.name}"
    return renames, fields


def is_run_config(typ: Type | None) -> bool:
    proper = get_proper_type(typ) if typ is not None else None
    if isinstance(proper, UnionType):  # RunConfig | None
        return any(is_run_config(item) for item in proper.items)
    return isinstance(proper, Instance) and proper.type.fullname == RUN_CONFIG


@dataclasses.dataclass(frozen=True)
class Edit:
    line: int  # 1-based
    end: int  # character offset just past the attribute's name on that line
    old: str
    new: str


class Finder:
    """The attribute reads on RunConfig values in one module, and the places to edit by hand. It walks the
    module's names and attributes (mypy's compiled visitors cannot be subclassed from Python)."""

    def __init__(self, tree: MypyFile, types: Mapping[Expression, Type], renames: dict[str, str],
                 fields: dict[str, frozenset[str]], source: list[str]):
        self.types, self.renames, self.fields = types, renames, fields
        self.edits: list[Edit] = []
        self.new_form: set[tuple[int, int]] = set()  # (line, end) of config.web in config.web.port
        self.manual: list[str] = []
        collector = NameAndMemberCollector()
        tree.accept(collector)
        for expr in [*collector.name_exprs, *collector.member_exprs]:
            if isinstance(expr, MemberExpr):
                self.member(expr)
            if expr.fullname == RUN_CONFIG and expr.end_line and expr.end_column is not None:
                self.call(expr, source[expr.end_line - 1].encode())

    def member(self, o: MemberExpr) -> None:
        inner = o.expr
        if isinstance(inner, MemberExpr) and inner.name in self.fields and o.name in self.fields[inner.name]:
            self.new_form.add((inner.end_line or 0, inner.end_column or 0))
        if o.name not in self.renames or o.end_line is None or o.end_column is None:
            return
        typ = self.types.get(inner)
        if is_run_config(typ):
            self.edits.append(Edit(o.end_line, o.end_column, o.name, self.renames[o.name]))
        elif (typ is None or isinstance(get_proper_type(typ), AnyType)) and _named_config(inner):
            self.manual.append(f"{o.line}: untyped {_text(inner)}.{o.name} (rename by hand if a RunConfig)")

    def call(self, ref: RefExpr, line: bytes) -> None:
        """``RunConfig(micro_batch=8, ...)`` (flat options) -> ``RunConfig.of(...)``; config.py builds
        the sectioned form itself and is not rewritten."""
        end = ref.end_column or 0
        if line[end:end + 1] == b"(":
            self.edits.append(Edit(ref.end_line or 0, end, "RunConfig", "RunConfig.of"))

    def kept(self) -> list[Edit]:
        """The edits, less the uses of a section name that are already the new form."""
        return [e for e in self.edits if not (e.old in self.fields and (e.line, e.end) in self.new_form)]


def _named_config(expr: object) -> bool:
    return bool(re.search(r"(^|_)(config|cfg)$", _text(expr)))


def _text(expr: object) -> str:
    if isinstance(expr, NameExpr):
        return expr.name
    if isinstance(expr, MemberExpr):
        return f"{_text(expr.expr)}.{expr.name}"
    return "?"


def stand_ins(text: str) -> list[str]:
    """``config=SimpleNamespace(notify=...)``: a test's stand-in for a RunConfig, which no type names."""
    renames, _ = mapping()
    notes = []
    for match in re.finditer(r"config\s*=\s*(?:types\.)?SimpleNamespace\(([^()]*)", text):
        for key in re.findall(r"\b(\w+)\s*=(?!\s*(?:types\.)?SimpleNamespace\()", match.group(1)):
            if key in renames:
                line = text.count("\n", 0, match.start()) + 1
                notes.append(f"{line}: a stand-in config with {key}= (by hand: {renames[key]})")
    return notes


def python_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from (p for p in sorted(path.rglob("*.py")) if ".venv" not in p.parts)
        elif path.suffix == ".py":
            yield path


def sources(files: list[Path]) -> list[BuildSource]:
    """oomguard/ by its module names; every other file under a name of its own (tests/ has no packages,
    and two test files may share a name)."""
    out = []
    for i, path in enumerate(files):
        rel = path.resolve().relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts) if rel.parts[0] == "oomguard" else f"_rename_{i}_{path.stem}"
        out.append(BuildSource(str(path), module.removesuffix(".__init__")))
    return out


def analyse(files: list[Path]) -> dict[str, Finder]:
    """Type-check ``files`` (with oomguard/, for RunConfig's types) and find the edits, by file."""
    options = Options()
    options.preserve_asts = True
    options.export_types = True
    options.check_untyped_defs = True
    options.ignore_missing_imports = True
    options.follow_imports = "skip"  # torch and the like: Any (every oomguard module is a source)
    options.incremental = False
    every = sorted({p.resolve() for p in files} | set(python_files([ROOT / "oomguard"])))
    result = build.build(sources(every), options)
    renames, fields = mapping()
    wanted = {str(p.resolve()) for p in files} - {str(Path(config_module.__file__).resolve())}
    found: dict[str, Finder] = {}
    for state in result.graph.values():
        path = str(Path(state.xpath).resolve())
        if state.tree is None or path not in wanted:
            continue
        source = Path(path).read_text(encoding="utf-8").splitlines()
        found[path] = Finder(state.tree, result.types, renames, fields, source)
    return found


def rewrite(path: Path, edits: list[Edit]) -> str:
    """The file with each edit made. mypy's columns count UTF-8 bytes, as Python's ast does."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for edit in sorted(edits, key=lambda e: (e.line, e.end), reverse=True):
        raw = lines[edit.line - 1].encode("utf-8")
        start = edit.end - len(edit.old)
        assert raw[start:edit.end].decode() == edit.old, (path, edit)
        lines[edit.line - 1] = (raw[:start] + edit.new.encode() + raw[edit.end:]).decode("utf-8")
    return wrap("".join(lines), {edit.line for edit in edits})


def wrap(text: str, touched: set[int]) -> str:
    """Break each touched line that the rename made longer than WIDTH after its last comma that fits,
    the rest aligned under the bracket it is in (the project's visual indent); repeated while it helps."""
    for _ in range(8):
        lines = text.splitlines(keepends=True)
        cut = _cut(text, {n for n in touched if len(lines[n - 1].rstrip("\n")) > WIDTH})
        if cut is None:
            return text
        row, col, indent = cut
        line = lines[row - 1]
        lines[row - 1] = line[:col + 1] + "\n" + " " * indent + line[col + 1:].lstrip(" ")
        text = "".join(lines)
        touched = {n + 1 if n > row else n for n in touched} | {row + 1}
    return text


def _cut(text: str, long: set[int]) -> tuple[int, int, int] | None:
    """(line, column of a comma, indent for what follows) for the first long line, or None. The comma is
    the last that fits among the least nested; the indent is the first argument's column in its bracket."""
    opened: list[list[int]] = []  # [row, column of the first token after the bracket]
    best: dict[int, tuple[int, int, int]] = {}  # row -> (-depth, column, indent)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if opened and opened[-1][1] < 0 and token.type not in (tokenize.NL, tokenize.COMMENT):
            opened[-1][1] = token.start[1]  # a hanging bracket: its arguments start on the next line
        if token.type != tokenize.OP:
            continue
        if token.string in "([{":
            opened.append([token.start[0], -1])
        elif token.string in ")]}":
            opened.pop()
        elif token.string == "," and opened and token.start[0] in long and token.start[1] < WIDTH:
            here = (-len(opened), token.start[1], opened[-1][1])
            best[token.start[0]] = max(best.get(token.start[0], here), here)
    row = min(best, default=None)
    return None if row is None else (row, best[row][1], best[row][2])


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("paths", nargs="*", type=Path, help="files or folders (default: oomguard tests scripts)")
    cli.add_argument("--check", action="store_true", help="change nothing; exit 1 if something would change")
    args = cli.parse_args(argv)
    files = list(python_files(args.paths or [ROOT / "oomguard", ROOT / "tests", ROOT / "scripts"]))
    files = [f for f in files if f.resolve() != Path(__file__).resolve()]
    changed = 0
    for name, finder in sorted(analyse(files).items()):
        path = Path(name)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for note in finder.manual + stand_ins(path.read_text(encoding="utf-8")):
            print(f"{shown}:{note}")
        text = rewrite(path, finder.kept())
        if text != path.read_text(encoding="utf-8"):
            changed += 1
            print(f"{shown}: {len(finder.kept())} attribute(s) renamed")
            if not args.check:
                path.write_text(text, encoding="utf-8")
    print(f"{changed} file(s) {'to change' if args.check else 'changed'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
