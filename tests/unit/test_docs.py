"""The documentation cannot drift: docs/cli.md is what scripts/gen_cli_docs.py makes of the real
parser, every doc the README links to exists, and every relative link and anchor resolves."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SUPERVISOR = ROOT / "oomguard" / "supervisor"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def _load_generator() -> ModuleType:
    path = ROOT / "scripts" / "gen_cli_docs.py"
    spec = importlib.util.spec_from_file_location("gen_cli_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load_generator()


def _prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


def _relative(target: str) -> bool:
    return bool(target) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_cli_reference_is_current(generator: ModuleType) -> None:
    expected = generator.render()
    current = (DOCS / "cli.md").read_text(encoding="utf-8") if (DOCS / "cli.md").exists() else ""
    assert current == expected, "docs/cli.md is out of date: run python scripts/gen_cli_docs.py"


def test_check_mode_fails_on_a_stale_reference(
    generator: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(generator.render().replace("--micro-batch", "--micro-batches"), encoding="utf-8")
    monkeypatch.setattr(generator, "OUTPUT", stale)
    assert generator.main(["--check"]) == 1
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and "out of date" in message
    generator.main([])
    assert generator.main(["--check"]) == 0


def test_reference_covers_every_command(generator: ModuleType) -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    for command in list(generator.commands(generator.load_parser()))[1:]:
        assert f"## `{command.name}`" in text


def test_readme_links_the_docs_and_they_exist() -> None:
    linked = {target.split("#")[0] for target in links(README)}
    docs = {t for t in linked if t.startswith("docs/") and t.endswith(".md")}
    for name in ("cli", "api", "worker", "operations", "benchmarks", "forms", "failures", "outputs", "architecture"):
        assert f"docs/{name}.md" in docs, f"README.md does not link docs/{name}.md"
    for target in sorted(docs):
        assert (ROOT / target).is_file(), f"README.md links {target}, which does not exist"
    orphans = {f"docs/{p.name}" for p in DOCS.glob("*.md")} - docs
    assert not orphans, f"docs not linked from README.md: {sorted(orphans)}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if not _relative(target):
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target} (no heading #{fragment} in {path.relative_to(ROOT)})")
    assert not broken, f"broken links in {page.relative_to(ROOT)}: {broken}"


def test_slug_matches_github() -> None:
    assert slug("`oomguard run`") == "oomguard-run"
    assert slug("Memory watch: seeing the OOM coming, and learning what fits") == (
        "memory-watch-seeing-the-oom-coming-and-learning-what-fits"
    )
    assert slug("Set-up: two commands") == "set-up-two-commands"


def test_readme_is_read_in_five_minutes() -> None:
    """Five minutes at 250 words a minute; the forms, tables, sample outputs and benchmarks live in docs/."""
    words = len(README.read_text(encoding="utf-8").split())
    assert words <= 1250, f"README.md has {words} words: move the detail to docs/ and link it"


def test_readme_test_command_is_what_ci_runs() -> None:
    setup = README.read_text(encoding="utf-8").split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```bash\n(.*?)^```", setup, re.MULTILINE | re.DOTALL)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci[-1] == f"exec {commands[1]}", ci[-1]


def test_architecture_opens_with_its_picture() -> None:
    """The first thing under the title is the picture of the flow, and the module map after it names
    files that exist in the room (directory) it puts them in."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    body = text.split("\n", 1)[1].lstrip("\n")
    assert body.startswith("```"), body[:80]
    picture = body.split("```", 2)[1]
    for room in ("loop", "observe/", "decide/", "run/", "record/", "web/"):
        assert room in picture, room
    (mermaid,) = re.findall(r"^```mermaid\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    missing, room = [], ""
    for line in mermaid.splitlines():
        if sub := re.match(r'\s*subgraph \w+\["(\w+)/"\]', line):
            room = sub.group(1)
        elif line.strip() == "end":
            room = ""
        elif room:
            missing += [f"{room}/{name}" for name in re.findall(r"\b(\w+\.py)\b", line)
                        if not (SUPERVISOR / room / name).is_file()]
    assert not missing, f"docs/architecture.md's picture names files not in the tree: {missing}"
