"""A worker for the fault tests: each mode is a real behaviour (a real full disk, a real flood, a real
progress bar), chosen on the command line. Standard library only, so it starts fast."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path


def fill_disk(args: argparse.Namespace) -> None:
    """Fill the disk under --path, keep training (printing) while it is full, then free it: a worker
    that handles ENOSPC itself must not be hurt by oomguard's own bookkeeping failing."""
    filler = args.path / "filler.bin"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    print("disk full; training on", flush=True)
    deadline = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        print(f"step {step} " + "x" * 200, flush=True)
        time.sleep(0.01)
    filler.unlink()
    print("space freed", flush=True)
    time.sleep(args.after)
    print("done", flush=True)


def checkpoint_enospc(args: argparse.Namespace) -> None:
    """Write checkpoints to --path until the disk is full; die of the OSError as a script would."""
    step = 0
    while True:
        step += 1
        with open(args.path / f"ckpt-{step}.bin", "wb") as fh:
            fh.write(os.urandom(1 << 20))
        time.sleep(0.001)


def progress_bar(args: argparse.Namespace) -> None:
    """A tqdm-style bar: redraws with \\r and no newline for --seconds."""
    deadline = time.monotonic() + args.seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        sys.stdout.write(f"\r{i:6d} it [{'#' * (i % 30):30s}]")
        sys.stdout.flush()
        time.sleep(0.1)
    sys.stdout.write("\n")


def long_line(args: argparse.Namespace) -> None:
    """--mib MiB in one line without a newline, then a pause with the line still open."""
    block = b"y" * (1 << 20)
    for _ in range(args.mib):
        sys.stdout.buffer.write(block)
    sys.stdout.buffer.flush()
    time.sleep(args.after)
    print("\nline done", flush=True)


def flood(args: argparse.Namespace) -> None:
    """--mib MiB of short lines as fast as Python writes them (stdout block-buffered)."""
    line = b"step 123456 loss 0.123456 lr 0.000300 tokens/s 123456.7 mem 1234 MiB " + b"x" * 10 + b"\n"
    out = os.fdopen(sys.stdout.fileno(), "wb", buffering=1 << 16, closefd=False)
    for _ in range(args.mib * (1 << 20) // len(line)):
        out.write(line)
    out.flush()


def setsid_child(args: argparse.Namespace) -> None:
    """A grandchild in a session of its own (out of oomguard's process group), its pid in --path."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    args.path.write_text(str(child.pid))
    print("grandchild started", flush=True)
    time.sleep(args.seconds)


def crash_once(args: argparse.Namespace) -> None:
    """Attempt 1 runs --seconds and crashes; later attempts finish after --after seconds."""
    first = os.environ.get("OOMGUARD_ATTEMPT", "1") == "1"
    print(f"attempt {os.environ.get('OOMGUARD_ATTEMPT')}", flush=True)
    time.sleep(args.seconds if first else args.after)
    if first:
        sys.exit(3)


def ckpt_train(args: argparse.Namespace) -> None:
    """Train --steps steps, a checkpoint every --every (written in two parts, so a kill can tear one),
    resuming from --resume-from. Each start appends "pid given newest-valid" to --record so the
    campaign can check oomguard passed the newest valid checkpoint (and whether the one given was)."""
    args.path.mkdir(parents=True, exist_ok=True)
    valid = sorted(p for p in args.path.glob("ckpt-*.pt") if p.read_bytes().endswith(b"END\n"))
    given = str(args.resume_from) if args.resume_from else ""
    data = Path(given).read_bytes() if given else b""
    intact = int(data.endswith(b"END\n"))
    with open(args.record, "a") as fh:
        fh.write(f"{os.getpid()} {given or '-'} {valid[-1] if valid else '-'} {intact}\n")
    step = 0
    if given:
        if not data.endswith(b"END\n"):
            print(f"checkpoint is corrupt: {given}", flush=True)
            sys.exit(1)
        step = int(data.split()[0])
    while step < args.steps:
        step += 1
        time.sleep(args.seconds)
        if step % args.every == 0:
            with open(args.path / f"ckpt-{step:06d}.pt", "wb") as fh:
                fh.write(f"{step}\n".encode() + b"w" * 4096)
                fh.flush()
                time.sleep(0.02)  # a kill now leaves a torn checkpoint behind
                fh.write(b"END\n")
        print(f"step {step}", flush=True)


def sleep(args: argparse.Namespace) -> None:
    print("sleeping", flush=True)
    time.sleep(args.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["fill_disk", "checkpoint_enospc", "progress_bar", "long_line", "flood",
                                    "sleep", "setsid_child", "crash_once",
                                    "ckpt_train"])
    p.add_argument("--path", type=Path, default=Path("."))
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--after", type=float, default=1.5)
    p.add_argument("--mib", type=int, default=50)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--record", type=Path, default=Path("starts.txt"))
    p.add_argument("--resume-from", type=Path)
    args = p.parse_args()
    globals()[args.mode](args)


if __name__ == "__main__":
    main()
