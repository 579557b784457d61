"""What filled memory, where users look: ``/api/status`` and ``/metrics`` from a real uvicorn, and the
dashboard's stacked bar per attempt in Debian's chromium (Playwright), over a journal holding real
``memory_breakdown`` events written with the journal's own API (the format in docs/outputs.md)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from oomguard.supervisor.record.journal import Journal
from oomguard.web.server import WebServer, start_server

GIB = 1 << 30
MIB = 1 << 20
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.environ.get("OOMGUARD_BREAKDOWN_SCREENSHOT")  # where to save the bar's picture, if set


def breakdown(attempt: int, micro: int, rank: int, at: str, activations: int | None, cache: int | None,
              **over: Any) -> dict[str, Any]:
    return {"attempt": attempt, "micro_batch": micro, "rank": rank, "at": at, "device": "cuda:0",
            "weights": 2 * GIB, "frozen_weights": 0, "gradients": 2 * GIB, "optimizer_state": 4 * GIB,
            "optimizers": ["AdamW"], "activations": activations, "cache": cache, "total": None,
            "limit": 24 * GIB, "limit_kind": "gpu", "processes": None, **over}


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[WebServer]:
    """Attempt 1 at micro-batch 32 ran out of memory on both ranks (rank 1 the fuller; its cache not
    seen); attempt 2 at 16 fit, its peak read; attempt 3 was killed by the kernel (per process only)."""
    journal = Journal(tmp_path)
    journal.set_meta(supervisor_pid=os.getpid(), supervisor_started=psutil.Process().create_time())
    plan = {"micro_batch": 16, "grad_accum": 2, "global_batch": 32, "world_size": 1}
    for n in (1, 2, 3):
        journal.start_attempt(n, os.getpid(), plan, None, ["python", "train.py"], str(tmp_path / f"a{n}.log"))
    journal.event("memory_breakdown", 1, **breakdown(1, 32, 0, "oom", 12 * GIB, GIB))
    journal.event("memory_breakdown", 1, **breakdown(1, 32, 1, "oom", 14 * GIB, None, total=22 * GIB))
    journal.event("memory_breakdown", 2, **breakdown(2, 16, 0, "peak", 7 * GIB, GIB))
    journal.event("memory_breakdown", 3, **breakdown(
        3, 16, 0, "last_reading", None, None, device="cpu", weights=None, gradients=None, optimizer_state=None,
        limit=12 * GIB, limit_kind="cgroup", processes=[
            {"pid": 10, "role": "trainer", "name": "python", "rss": 6 * GIB},
            {"pid": 11, "role": "data-loader worker", "name": "pt_data_worker", "rss": 3 * GIB}]))
    journal.transition("starting", "running", "attempt 3 started", 3)
    web = start_server(tmp_path, None, "127.0.0.1", 0)
    try:
        yield web
    finally:
        web.stop()
        journal.close()


def test_status_and_metrics_over_http_carry_the_breakdown(served: WebServer) -> None:
    doc = httpx.get(served.url + "api/status", timeout=10).json()
    bars = doc["memory_breakdown"]
    assert [(b["attempt"], b["at"], b["rank"]) for b in bars] == [(1, "oom", 1), (2, "peak", 0), (3, "last_reading", 0)]
    assert {p["key"]: p["bytes"] for p in bars[0]["parts"]} == {
        "weights": 2 * GIB, "gradients": 2 * GIB, "optimizer_state": 4 * GIB, "activations": 14 * GIB, "cache": None}
    text = httpx.get(served.url + "metrics", timeout=10).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("oomguard_memory_breakdown")}
    # The newest attempt with a breakdown is the kernel kill: no part was seen, so no part has a sample;
    # its last reading per kind of process and the cgroup's limit have.
    assert not [key for key in samples if key.startswith("oomguard_memory_breakdown_bytes{")], samples
    assert samples == {'oomguard_memory_breakdown_limit_bytes{kind="cgroup",rank="0"}': 12 * GIB,
                       'oomguard_memory_breakdown_process_bytes{rank="0",role="trainer"}': 6 * GIB,
                       'oomguard_memory_breakdown_process_bytes{rank="0",role="data-loader worker"}': 3 * GIB,
                       "oomguard_memory_breakdown_attempt": 3}


sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (apt-get install chromium)")
def test_the_dashboard_draws_a_stacked_bar_per_attempt_with_the_limit_marked(served: WebServer) -> None:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(served.url)
            rows = page.locator("#breakdown .mem-row")
            sync_api.expect(rows).to_have_count(3)
            failed, fit, killed = rows.nth(0), rows.nth(1), rows.nth(2)
            sync_api.expect(failed.locator(".mem-row-label")).to_have_text(
                "attempt 1 · micro-batch 32 · rank 1 · at the OOM · cuda:0")
            segments = failed.locator(".mem-seg")
            sync_api.expect(segments).to_have_count(4)  # the cache was not seen: no segment, named below
            assert [segments.nth(i).get_attribute("data-part") for i in range(4)] == [
                "weights", "gradients", "optimizer_state", "activations"]
            sync_api.expect(failed.locator(".not-seen[data-part=cache]")).to_have_text("cache not seen")
            sync_api.expect(failed.locator(".mem-caption")).to_contain_text("activations 14.0 GiB")
            sync_api.expect(failed.locator(".mem-caption")).to_contain_text("limit 24.0 GiB (gpu)")
            # Widths in proportion to the bytes, on one scale for every bar; the limit's mark where 24 GiB is.
            width = {i: segments.nth(i).bounding_box()["width"] for i in range(4)}
            assert width[1] == pytest.approx(width[0], rel=0.02) and width[2] == pytest.approx(2 * width[0], rel=0.02)
            assert width[3] == pytest.approx(7 * width[0], rel=0.02)
            bar = failed.locator(".mem-bar").bounding_box()
            mark = failed.locator(".mem-limit").bounding_box()
            assert mark["x"] - bar["x"] == pytest.approx(12 * width[0], rel=0.03)  # 24 GiB = 12 × the 2 GiB of weights
            assert fit.locator(".mem-seg[data-part=cache]").bounding_box()["width"] == pytest.approx(
                width[0] / 2, rel=0.05)
            sync_api.expect(fit.locator(".mem-row-label")).to_contain_text("at its peak (it fit)")
            # The kernel kill: no part seen, so the bar is the last reading per kind of process.
            assert [killed.locator(".mem-seg").nth(i).get_attribute("data-part") for i in range(2)] == [
                "trainer", "data-loader worker"]
            sync_api.expect(killed.locator(".not-seen")).to_have_count(5)
            sync_api.expect(killed.locator(".processes")).to_have_text(
                "by process: trainer python (pid 10) 6.0 GiB, data-loader worker pt_data_worker (pid 11) 3.0 GiB")
            if SCREENSHOT:
                page.locator("#breakdown-card").screenshot(path=SCREENSHOT)
            assert errors == []
        finally:
            browser.close()
