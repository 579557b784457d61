"""Take ``docs/dashboard.png``: the dashboard of a real run just after a recovered OOM.

    .venv/bin/python scripts/screenshot_dashboard.py [--out docs/dashboard.png]

Starts ``oomguard run`` on the test worker (micro-batch 16 and 8 run out of memory with PyTorch's
real message, 4 trains and checkpoints), waits for a few samples and a checkpoint, and photographs
the page in Debian's headless Chromium through Playwright (no browser download).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "web"))
from harness import Run, start_run  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def wait_for_story(run: Run) -> None:
    """Two OOMs, the recovery, a checkpoint and enough samples to draw."""
    run.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4, timeout=30)
    run.wait_for(lambda d: d["newest_checkpoint"] is not None, timeout=30)
    time.sleep(4)


def shoot(url: str, out: Path) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme="light")
            page.goto(url)
            expect(page.locator("#live")).to_have_text("live")
            expect(page.locator("#chart line.marker-oom")).to_have_count(2)
            page.wait_for_timeout(500)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="oomguard-shot-") as tmp:
        run = start_run(Path(tmp), env={"MB_PER_SAMPLE": "24", "STEP_S": "0.2"})
        try:
            wait_for_story(run)
            shoot(run.url, args.out)
        finally:
            run.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
