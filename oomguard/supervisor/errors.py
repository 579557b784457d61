"""The one error type a user sees: a bad option, value or command, said in one line.

Tested through the refusals it carries: tests/unit/supervisor/test_config.py.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A problem the user fixes by changing how they call oomguard; the CLI prints it and exits 2.

    ``option`` names what is wrong (``--micro-batch``) and ``fix`` says what to do instead.
    """

    def __init__(self, option: str, problem: str, fix: str = "") -> None:
        self.option = option
        self.problem = problem
        self.fix = fix
        text = f"{option}: {problem}" if option else problem
        super().__init__(f"{text}; {fix}" if fix else text)
