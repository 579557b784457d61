"""Mutation testing of the core: does a test fail when the policy, the classifier or a reader changes?

mutmut (``pip install -e '.[mutation]'``) copies the package into ``mutants/``, changes one
operator, constant or argument at a time inside the functions of the modules ``[tool.mutmut]
only_mutate`` names (decide/ and observe/'s readers: output, progress, liveness, checkpoints,
resume, steps, ckptname, ckptstep), and runs the unit tests that reach the changed function
(``pytest_add_cli_args_test_selection``). A mutant no test notices *survived*. This prints, per
module, how many mutants the tests killed; the scores and every survivor judged equivalent are in
docs/mutation.md. Not run in CI: it takes 1 to 5 minutes per module on a loaded 2-core machine.

    python bench/mutation.py                        # every module, then the table
    python bench/mutation.py decide.policy observe.output
    python bench/mutation.py --report               # the table from the last runs, running nothing
    python bench/mutation.py --survivors decide.policy   # each survivor's diff
    python bench/mutation.py --again decide.policy       # only the last run's survivors, after new tests

Naming modules runs only their mutants: mutmut's progress line counts every module's mutants (4,676
in all), the ones not run included, so ``300/4676`` does not mean all are being run.

Results persist in ``mutants/``: naming a module runs all its mutants again; ``--report`` only reads
them. ``--again`` tests only the survivors and keeps every other verdict: a test added cannot make a
killed mutant survive. (mutmut resets every verdict when the test selection in pyproject.toml
changes; ``--again`` puts the kept ones back.)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "oomguard.supervisor"
# common/batch.py (the batch arithmetic) is outside PACKAGE: mutmut run "oomguard.common.batch.*"
MODULES = (
    "decide.policy", "decide.classify", "observe.output", "observe.progress",
    "decide.attribution", "observe.checkpoints", "sizing.trend",
    "sizing.memmodel", "record.fitstore",
)
# mutmut's exit codes of a mutant's test run (mutmut/stats.py), folded into what the table shows
KILLED = {1: "killed", 3: "killed", 36: "killed", -24: "killed", 24: "killed", 152: "killed", 255: "killed",
          37: "killed"}  # a timeout or a type error is a mutant noticed
SURVIVED = {0: "survived", 5: "no tests", 33: "no tests"}


def _env() -> dict[str, str]:
    # The mutated copy must be the one imported: the worktree on PYTHONPATH would shadow it.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(module: str) -> int:
    """Run every mutant of one module; mutmut's own progress goes to the terminal."""
    pattern = f"{PACKAGE}.{module}.*"
    return subprocess.call([sys.executable, "-m", "mutmut", "run", pattern], cwd=ROOT, env=_env())


def _meta(module: str) -> Path:
    return ROOT / "mutants" / (module.replace(".", "/").join((f"{PACKAGE.replace('.', '/')}/", ".py.meta")))


def again(modules: list[str]) -> int:
    """Run only the last run's survivors of these modules again, in one mutmut run (its reset of
    every verdict after a change of the test selection happens once), keeping the other verdicts."""
    kept = {m: json.loads(_meta(m).read_text())["exit_code_by_key"] for m in modules if _meta(m).exists()}
    names = [name for m in modules for name in survivors(m)]
    if not names:
        return 0
    code = subprocess.call([sys.executable, "-m", "mutmut", "run", *names], cwd=ROOT, env=_env())
    for module, verdicts in kept.items():
        data = json.loads(_meta(module).read_text())
        rerun = data["exit_code_by_key"]
        data["exit_code_by_key"] = {name: rerun.get(name) if name in names else verdict
                                    for name, verdict in verdicts.items()}
        _meta(module).write_text(json.dumps(data, indent=4))
    return code


def tally(module: str) -> Counter[str]:
    """Killed / survived / no tests / not run for one module, from mutmut's result file."""
    meta = _meta(module)
    if not meta.exists():
        return Counter()
    codes = json.loads(meta.read_text())["exit_code_by_key"].values()
    return Counter(KILLED.get(c) or SURVIVED.get(c) or ("not run" if c is None else "suspicious") for c in codes)


def survivors(module: str) -> list[str]:
    meta = _meta(module)
    if not meta.exists():
        return []
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return sorted(name for name, code in codes.items() if code in SURVIVED)


def diffs(module: str) -> str:
    """Each survivor's change as a diff against the original function, read from mutmut's mutated
    copy (``mutmut show`` does the same, one slow start per mutant)."""
    source_path = _meta(module).with_suffix("")
    names = survivors(module)
    if not names:
        return ""
    source = source_path.read_text()
    functions = {node.name: ast.get_source_segment(source, node) or "" for node in ast.walk(ast.parse(source))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []
    for name in names:
        mangled = name.rsplit(".", 1)[1]
        original = functions.get(mangled.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "").splitlines()
        mutant = [line.replace(mangled, mangled.rsplit("__mutmut_", 1)[0] + "__mutmut_orig")
                  for line in functions.get(mangled, "").splitlines()]
        changed = [line for line in difflib.unified_diff(original, mutant, lineterm="", n=1)
                   if not line.startswith(("---", "+++"))]
        out.append(f"# {name}\n" + "\n".join(changed))
    return "\n".join(out)


def table(modules: list[str]) -> str:
    lines = ["| module | mutants | killed | survived | no tests | score |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for module in modules:
        c = tally(module)
        total = sum(c.values()) - c["not run"]
        if not total or c["not run"]:
            lines.append(f"| {module} | not measured | | | | |")
            continue
        lines.append(f"| {module} | {total} | {c['killed']} | {c['survived']} | {c['no tests']} | "
                     f"{100 * c['killed'] / total:.1f} % |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules under {PACKAGE} (default: all of {len(MODULES)})")
    parser.add_argument("--report", action="store_true", help="print the table from the last runs only")
    parser.add_argument("--survivors", action="store_true", help="print each survivor's diff only")
    parser.add_argument("--again", action="store_true", help="test only the last run's survivors again")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; one of: {', '.join(MODULES)}")
    modules = list(args.modules or MODULES)
    if args.survivors:
        for module in modules:
            print(diffs(module))
        return 0
    if args.again and again(modules) != 0:
        print("mutmut failed", file=sys.stderr)
        return 1
    if not args.report and not args.again:
        for module in modules:
            if run(module) != 0:
                print(f"mutmut failed on {module}", file=sys.stderr)
                return 1
    print(table(modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
