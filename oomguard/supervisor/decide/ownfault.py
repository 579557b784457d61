"""Whether an attempt died of oomguard's own code: the probe in the worker, or a spare's handover.

oomguard adds code to the worker's process: the probe (``oomguard/probe/``, loaded from
``probe/site/sitecustomize.py`` under the private name ``_oomguard_probe``) and, when an attempt was
handed to a spare interpreter, the spare's bootstrap (``supervisor/run/sparestart.py``), which runs
in the worker's process before the script. When one of them raises into the program, the failure is
ours, not the script's: the next attempt runs without that addition and nothing is counted against
the script or its batch (``decide.policy``).

The evidence is the traceback the worker died with, measured, never guessed: its innermost frame
(the code that raised) must be a file of that addition. A traceback that only passes through ours
on its way to the program's own exception (our ``torch.save`` wrapper calling the real save, our
chained ``sys.excepthook``) has the program's or torch's frame innermost and stays the script's.
Frames of ``oomguard/worker/`` are the probe's only when the probe called them (the probe writes
its records through ``worker/protocol.py``); a script that uses the worker library itself owns its
calls. Only a crash counts: a memory failure is the batch's wherever the allocation happened to be.
One more is measured outside the traceback: a spare that had exited when the attempt was handed to
it (``run/spare.py``; the kernel's OOM killer takes a spare first), where the script never ran.

A probe record of state ``failed`` is no such evidence: the probe writes one where it caught its own
failure and the program went on without that part, so a death after it is not shown to be ours.
Pure: the scanner's frames and the paths of our code come from the loop.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Collection
from dataclasses import dataclass

from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.observe.output import OutputScanner, Site

# After the traceback a process dies with come only its last words: the exception's message (dynamo's
# runs to a few lines after its ``from user code:`` frames), atexit handlers, a launcher's line.
# A traceback further back was printed and survived (the program caught and logged it).
RECENT_LINES = 50
PROBE_DIR = "probe/"  # oomguard/probe/, its site/sitecustomize.py among them
SPARE_FILE = "supervisor/run/sparestart.py"  # what a spare runs in the worker's process before the script
LIBRARY_DIR = "worker/"  # the worker library: the probe writes through its protocol; a script may use it


class Addition(enum.Enum):
    """What oomguard adds to a run that can be left out of the next attempt."""

    PROBE = "probe"
    SPARE = "spare"

    @property
    def switch(self) -> str:
        return "--no-probe" if self is Addition.PROBE else "--no-spare"


@dataclass(frozen=True)
class OwnCode:
    """Where the worker's tracebacks show oomguard's code: the package's directory (``roots``: as the
    worker was given it, and with its links resolved)."""

    roots: tuple[str, ...]

    def relative(self, file: str) -> str | None:
        """The file's path inside the package (``probe/forward.py``), or None when it is not ours."""
        for root in self.roots:
            if file.startswith(root.rstrip(os.sep) + os.sep):
                return file[len(root.rstrip(os.sep)) + 1:].replace(os.sep, "/")
        return None

    def addition_of(self, file: str) -> Addition | None:
        relative = self.relative(file)
        if relative is None:
            return None
        if relative.startswith(PROBE_DIR):
            return Addition.PROBE
        return Addition.SPARE if relative == SPARE_FILE else None

    def shown(self, site: Site) -> str:
        """``oomguard/probe/forward.py, line 85, in post``."""
        relative = self.relative(site.file) or site.file
        return f"oomguard/{relative}, line {site.line}, in {site.function}"


@dataclass(frozen=True)
class OwnFault:
    """An attempt that died in oomguard's own code, and which addition the next one runs without."""

    addition: Addition
    frame: str  # the innermost frame, as ``OwnCode.shown`` writes it

    @property
    def reason(self) -> str:
        """The attempt's decision: what failed and what follows."""
        if self.addition is Addition.PROBE:
            return f"oomguard's probe failed ({self.frame}); the next attempt runs without the probe"
        return (f"oomguard's spare interpreter failed at its handover ({self.frame}); the next attempt starts "
                "cold, without spares")

    def off(self, attempt: int) -> str:
        """What status says of the addition from then on."""
        if self.addition is Addition.PROBE:
            return f"turned off after attempt {attempt}, which oomguard's probe failed ({self.frame})"
        return (f"off after attempt {attempt}, whose handover failed ({self.frame}); later attempts start cold, "
                "as with --no-spare")


def own_fault(kind: FailureKind | None, scan: OutputScanner, in_use: Collection[Addition],
              code: OwnCode, handover_lost: str | None = None) -> OwnFault | None:
    """The addition of ours (among ``in_use``, those the attempt ran with) whose code raised the
    exception the worker died with, or None: the failure is the script's. ``handover_lost``: the
    spare the attempt was handed to had exited before the handover (why): the script never ran, so
    whatever ended the attempt (the kernel's OOM killer choosing the spare first) is the spare's."""
    if handover_lost is not None and Addition.SPARE in in_use:
        return OwnFault(Addition.SPARE, handover_lost)
    sites = scan.sites
    if kind is not FailureKind.CRASH or not sites or scan.lines - scan.framed_at > RECENT_LINES:
        return None
    for site in reversed(sites):  # innermost first
        relative = code.relative(site.file)
        if relative is not None and relative.startswith(LIBRARY_DIR):
            continue  # the library's frame: whose call it was decides
        addition = code.addition_of(site.file)
        if addition is None or addition not in in_use:
            return None
        return OwnFault(addition, code.shown(sites[-1]))
    return None
