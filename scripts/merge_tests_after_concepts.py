# ruff: noqa  (a one-time merge aid, deleted after the merge)
"""A one-time merge aid for issue 36 (delete it once tests-layout and concepts are both merged): after
`git merge concepts` on top of tests-layout (or the reverse), resolves the tests' conflicts mechanically.

1. A test file tests-layout deleted (merged into its module's file) and concepts edited: concepts' hunks are
   applied where the same lines now are (tests/unit/..., tests/e2e/...); hunks not found verbatim (the import
   lines, which tests-layout merged and sorted) are left to step 3. The old file is removed.
2. A content conflict in a test file: both sides' lines are kept (step 3 makes them agree).
3. Every test file: imports of a module the mapping moved or merged name the new module (same names), then
   `ruff check --fix` merges and drops the duplicates. What still fails shows in `pytest --collect-only`.
Run from the repository root with the merge in progress:
    python3 scripts/merge_tests_after_concepts.py /work/wt/concepts/MAPPING.md [BASE, default main]
Then resolve pyproject.toml (keep tests-layout's test selection) and ops/systemd.py's docstring by hand.
"""
import re, subprocess, sys
from pathlib import Path

mapping_md, base = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else 'main')
git = lambda *a: subprocess.run(['git', *a], capture_output=True, text=True).stdout

def module_map() -> dict[str, str]:
    out = {}
    for line in open(mapping_md):
        m = re.match(r'\| (\S+\.py)(?: \([^|]*\))? \| (\S+\.py) \| (moved|merged into)', line)
        if m and not m.group(1).startswith('('):
            dot = lambda p: 'oomguard.' + p[:-3].replace('/', '.')
            if m.group(3) == 'moved' or dot(m.group(1)) not in out:  # a module split in two: its moved half
                out[dot(m.group(1))] = dot(m.group(2))
    return out

status = [l for l in git('status', '--porcelain').splitlines()]
deleted_by_us = [l[3:] for l in status if l.startswith('DU ') and l[3:].startswith('tests/')]
both = [l[3:] for l in status if l.startswith('UU ') and l[3:].startswith('tests/')]
candidates = [p for d in ('tests/unit', 'tests/e2e') for p in Path(d).rglob('test_*.py')]

def groups(path: str):
    """Each run of changed lines with one line of context either side: (before, old, new, after)."""
    diff = git('diff', base, 'MERGE_HEAD', '--', path).splitlines()
    body = [l for l in diff if l[:1] in '-+ @' and not l.startswith(('---', '+++'))]
    i = 0
    while i < len(body):
        if body[i][:1] in '-+':
            j = i
            while j < len(body) and body[j][:1] in '-+': j += 1
            before = body[i - 1][1:] if i and body[i - 1][:1] == ' ' else None
            after = body[j][1:] if j < len(body) and body[j][:1] == ' ' else None
            yield before, [l[1:] for l in body[i:j] if l[0] == '-'], [l[1:] for l in body[i:j] if l[0] == '+'], after
            i = j
        else:
            i += 1

def apply(old: list[str], new: list[str], before, after) -> bool:
    tries = []
    if before is not None and after is not None:
        tries.append(([before, *old, after], [before, *new, after]))
    tries.append((old, new))
    for o, n in tries:
        if not o: continue
        block = '\n'.join(o) + '\n'
        for c in candidates:
            text = c.read_text()
            if text.count(block) == 1 or (text.count(block) > 1 and o is not old):
                c.write_text(text.replace(block, '\n'.join(n) + '\n' if n else '', 1)); return True
    return False

left = []
for path in deleted_by_us:
    for before, old, new, after in groups(path):
        if any(l.startswith(('from oomguard', 'import oomguard')) for l in old + new) and all(
                l.startswith(('from ', 'import ', '    ', ')')) or not l.strip() for l in old + new):
            continue  # import lines: step 3 rewrites them
        if not old or not apply(old, new, before, after):
            left.append((path, old, new))
    git('rm', '-q', path)

for path in both:
    text = Path(path).read_text()
    text = re.sub(r'^<<<<<<< [^\n]*\n(.*?)^=======\n(.*?)^>>>>>>> [^\n]*\n', lambda m: m.group(2) + m.group(1), text,
                  flags=re.S | re.M)
    text = re.sub(r'^[ \t]*from [\w.]+ import \(\n(?=[ \t]*(?:from|import) )', '', text, flags=re.M)  # a side cut mid-import
    Path(path).write_text(text)

mods = module_map()
def rewrite(text: str) -> str:
    def from_line(m):
        mod, names = m.group(2), m.group(3)
        if mod in mods:
            return f'from {mods[mod]} import {names}'
        unchanged = m.group(0)[len(m.group(1)):]
        # from a package, modules imported by name
        pieces = [n.strip() for n in names.strip('()').replace('\n', ' ').split(',') if n.strip()]
        moved = [n for n in pieces if f'{mod}.{n.split(" as ")[0]}' in mods]
        if not moved: return unchanged
        keep = [n for n in pieces if n not in moved]
        out = [f'from {mod} import {", ".join(keep)}'] if keep else []
        for n in moved:
            name, _, alias = n.partition(' as ')
            new = mods[f'{mod}.{name}']; pkg, _, leaf = new.rpartition('.')
            out.append(f'from {pkg} import {leaf}' + (f' as {alias or name}' if (alias or name) != leaf else ''))
        return '\n'.join(out)
    text = re.sub(r'^([ \t]*)from (oomguard[\w.]*) import (\([^)]*\)|[^\n]+)',
                  lambda m: m.group(1) + from_line(m).replace('\n', '\n' + m.group(1)), text, flags=re.M)
    for old, new in sorted(mods.items(), key=lambda kv: -len(kv[0])):  # dotted names in strings and patches
        text = re.sub(rf'(?<![\w.]){re.escape(old)}(?![\w])', new, text)
    return text
for c in Path('tests').rglob('*.py'):
    t = c.read_text(); n = rewrite(t)
    if n != t: c.write_text(n)
import ast
def defines(module: str, name: str) -> bool:
    f = Path(*module.split('.')).with_suffix('.py')
    f = f if f.exists() else Path(*module.split('.'), '__init__.py')
    return f.exists() and re.search(rf'^(?:def|class) {re.escape(name)}\b|^{re.escape(name)}\b\s*[:=]', f.read_text(), re.M) is not None
for c in Path('tests').rglob('*.py'):
    text = c.read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        continue
    froms = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and (n.module or '').startswith('oomguard'):
            for a in n.names:
                froms.setdefault(a.asname or a.name, []).append((n, a))
    drop = {(id(n), a.name) for name, seen in froms.items() if len({x[0].module for x in seen}) > 1
            for n, a in seen if not defines(n.module, a.name) and any(defines(m.module, x.name) for m, x in seen)}
    if not drop:
        continue
    lines = text.splitlines(keepends=True)
    for n in sorted({n for name, seen in froms.items() for n, a in seen if (id(n), a.name) in drop}, key=lambda n: -n.lineno):
        keep = [a for a in n.names if (id(n), a.name) not in drop]
        new = f"from {n.module} import {', '.join(a.name + (f' as {a.asname}' if a.asname else '') for a in keep)}\n" if keep else ''
        lines[n.lineno - 1:n.end_lineno] = [new]
    c.write_text(''.join(lines))
Path('/tmp/ruff-of-head').mkdir(exist_ok=True); Path('/tmp/ruff-of-head/pyproject.toml').write_text(git('show', 'HEAD:pyproject.toml'))  # the merge may leave conflict marks in it
subprocess.run(['.venv/bin/ruff', 'check', '--config', '/tmp/ruff-of-head/pyproject.toml', 'tests', '--fix', '--unsafe-fixes', '-q', '--select', 'I,F401,F811'])
for path, old, new in left:
    print(f'not applied verbatim ({path}):', '\n  -' + '\n  -'.join(old if isinstance(old, list) else [old]), '\n  +' + '\n  +'.join(new))
print(git('status', '--porcelain').count('\n'), 'paths changed')
git('add', '-A', 'tests')
