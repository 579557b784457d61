"""The dashboard in real headless Chromium (Debian's ``chromium`` driven by Playwright).

Skipped, with the reason, where either is missing; the test setup installs them with
``apt-get install -y chromium`` and ``pip install playwright`` (no Playwright browser download).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import WORKER, Run, start_fleet, start_run
from support import WORKERS

from oomguard.supervisor.record.journal import Journal
from oomguard.web.server import start_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian chromium is not installed (apt-get install -y chromium)", allow_module_level=True)

pytestmark = pytest.mark.browser


@pytest.fixture()
def page() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 390, "height": 844})  # a phone
            yield context.new_page()
        finally:
            browser.close()


@pytest.fixture()
def recovered_run(tmp_path: Path) -> Iterator[Run]:
    """Micro-batch 16 and 8 run out of memory; 4 trains."""
    run = start_run(tmp_path)
    try:
        run.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4)
        yield run
    finally:
        run.stop()


def _wait_js(page: Any, expression: str, timeout: float) -> None:
    """Poll an expression from the test side. ``page.wait_for_function`` compiles its predicate
    inside the page, which the dashboard's CSP (no 'unsafe-eval') rightly forbids."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.1)


def test_dashboard_shows_a_recovered_oom_and_follows_the_run(page: Any, recovered_run: Run) -> None:
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(recovered_run.url)
    expect = sync_api.expect
    expect(page.locator("#state")).to_have_text("running")
    expect(page.locator("#reason")).to_contain_text("recovered from cuda oom at micro-batch 8")
    expect(page.locator("#batch")).to_have_text("4 × 16 = 64")
    expect(page.locator("#attempts tbody tr")).to_have_count(3)
    expect(page.locator("#attempts tbody")).to_contain_text("CUDA out of memory")
    expect(page.locator("#log")).not_to_be_empty()
    expect(page.locator("#live")).to_have_text("live")
    expect(page.locator("#chart line.marker-oom")).to_have_count(2)
    _wait_js(page, "Number(document.querySelector('#chart').dataset.points) >= 3", 10)
    assert page.locator("#chart polyline.series").count() >= 1
    assert page.evaluate("document.documentElement.scrollWidth") <= 391  # no sideways scrolling
    _follows_a_restart_and_a_stop(page, recovered_run)
    assert errors == []


def test_dashboard_shows_the_probes_steps_peaks_and_the_limit_line(page: Any, tmp_path: Path) -> None:
    """A worker writing the in-process probe's records (simulated, tests/workers/simulated_probe.py)
    under a 30% memory fraction: steps per second and the allocator's peak in the detail line, each
    attempt's allocated peak in the table, the fraction's cap as a line on the memory chart."""
    simulated = WORKERS / "simulated_probe.py"
    run = start_run(tmp_path, command=(sys.executable, str(simulated), "--fail-above", "4", "--steps", "100000",
                                       "--pace", "0.1", "--fraction", "0.3"))
    try:
        run.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4
                     and (d["progress"] or {}).get("allocated_peak") == 2 * 2**30, 60)  # attempt 3's own
        page.goto(run.url)
        expect = sync_api.expect
        expect(page.locator("#detail")).to_contain_text("steps/s", timeout=15_000)
        expect(page.locator("#detail")).to_contain_text("allocated peak 2.0 GiB of 24.0 GiB")
        expect(page.locator('#attempts tbody tr[data-attempt="1"] td.peak')).to_have_text("5.0 GiB")
        expect(page.locator("#chart line.limit")).to_have_count(1, timeout=15_000)
        assert page.locator("#chart line.limit").get_attribute("data-bytes") == str(int(80 * 2**30 * 0.3))
        assert page.evaluate("document.documentElement.scrollWidth") <= 391
    finally:
        run.stop()


def _follows_a_restart_and_a_stop(page: Any, run: Run) -> None:
    expect = sync_api.expect
    response = run.post("api/control/restart", headers={"Authorization": f"Bearer {run.token}"})
    assert response.status_code == 202
    expect(page.locator("#attempt")).to_have_text("attempt 4", timeout=15_000)
    expect(page.locator("#attempts tbody tr")).to_have_count(4)
    expect(page.locator("#state")).to_have_text("running")
    _wait_js(page, "Number(document.querySelector('#chart').dataset.markers) >= 4", 15)
    before = len(page.context.pages)
    assert run.cli("stop").returncode == 0
    expect(page.locator("#state")).to_have_text("stopped", timeout=15_000)
    expect(page.locator("#reason")).to_have_text("The run was stopped on request.")
    expect(page.locator("#live")).to_have_text("ended", timeout=15_000)  # no reconnecting to a server that is gone
    expect(page.locator("#ended")).to_have_text("The supervisor has exited. This page no longer updates.")
    expect(page.locator("#attempts tbody tr").nth(0).locator("td.kind")).not_to_have_text("running")
    page.wait_for_timeout(2500)  # past the stream's retry interval: nothing tried again (and the console heard)
    assert len(page.context.pages) == before


def test_dashboard_shows_the_final_state_when_the_server_goes_right_after_the_run_ends(
        page: Any, tmp_path: Path) -> None:
    """The race a full run once hit, made certain: the run's last journal records, then at once the
    supervisor's exit and its server's. A page refreshing its tables 250 ms after those records would
    find no server (ERR_CONNECTION_REFUSED in the console); the stream's ``end`` event brings the
    final tables instead, the page says the supervisor has exited, and asks nothing more."""
    journal = Journal(tmp_path)
    journal.set_meta(supervisor_pid=os.getpid(), supervisor_started=psutil.Process().create_time())
    plan = {"micro_batch": 4, "grad_accum": 16, "global_batch": 64, "world_size": 1}
    log = tmp_path / "logs" / "attempt-1.log"
    log.parent.mkdir()
    log.write_text("step 1\n")
    journal.start_attempt(1, os.getpid(), plan, None, ["python", "train.py"], str(log))
    journal.transition("starting", "running", "attempt 1 started", 1)
    web = start_server(tmp_path, None, "127.0.0.1", 0)
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    expect = sync_api.expect
    rows = page.locator("#attempts tbody tr")
    try:
        page.goto(web.url)
        expect(page.locator("#live")).to_have_text("live")
        expect(rows.nth(0).locator("td.kind")).to_have_text("running")
        journal.end_attempt(1, returncode=0, exit_code=0)
        journal.transition("running", "succeeded", "training finished", 1)
        web.broker.notify()
        web.stop(why="The supervisor has exited.")  # as the supervisor does once its loop is over
        expect(page.locator("#state")).to_have_text("succeeded")
        expect(page.locator("#reason")).to_have_text("Training finished successfully.")
        expect(rows.nth(0).locator("td.kind")).to_have_text("ok")  # the final table, not a request's
        expect(page.locator("#ended")).to_have_text("The supervisor has exited. This page no longer updates.")
        expect(page.locator("#live")).to_have_text("ended")
        page.wait_for_timeout(1000)  # past the page's 250 ms refresh (time.sleep would not deliver its console)
        assert errors == []
    finally:
        web.stop()
        journal.close()


@pytest.fixture()
def two_runs(tmp_path: Path) -> Iterator[tuple[Run, Run]]:
    """Two runs on one machine: ``a`` recovers from two OOMs at micro-batch 4, ``b`` trains at once."""
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    a = start_run(tmp_path / "runs" / "a")
    try:
        b = start_run(tmp_path / "runs" / "b", micro=4, global_batch=16)
    except BaseException:
        a.stop()
        raise
    try:
        a.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4)
        b.wait_for(lambda d: d["state"] == "running")
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_many_runs_page_lists_the_runs_live_and_links_to_each(page: Any, two_runs: tuple[Run, Run],
                                                                tmp_path: Path) -> None:
    a, b = two_runs
    damaged = tmp_path / "runs" / "old" / "journal.sqlite"
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a journal" * 400)
    os.utime(damaged, (time.time() - 600, time.time() - 600))
    fleet = start_fleet(tmp_path, tmp_path / "runs")
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    expect = sync_api.expect
    try:
        page.goto(fleet.url)
        cards = page.locator("#runs article.run")
        expect(cards).to_have_count(3)
        expect(page.locator("#counts")).to_have_text("3 runs: 1 damaged, 2 running")
        card_a, card_b, old = (page.locator(f'#runs article.run:has(.run-name:text-is("{n}"))')
                               for n in ("a/run", "b/run", "old"))
        expect(card_a.locator(".state")).to_have_text("running")
        expect(card_a.locator('[data-fact="batch"]')).to_have_text("4 × 16 × 1 = 64")
        expect(card_a.locator('[data-fact="failures"]')).to_have_text("2 (cuda_oom ×2)")
        expect(card_a.locator('[data-fact="supervisor"]')).to_contain_text("alive (pid ")
        expect(card_a.locator('[data-fact="progress"]')).to_contain_text("step ")
        expect(card_b.locator("a.dashboard")).to_have_attribute("href", b.url)
        expect(old.locator(".state")).to_have_text("damaged")
        expect(old.locator(".why")).to_contain_text("is not an SQLite database")
        assert page.evaluate("document.documentElement.scrollWidth") <= 391  # no sideways scrolling on a phone

        assert b.cli("stop").returncode == 0  # the list follows without a reload
        expect(card_b.locator(".state")).to_have_text("stopped", timeout=15_000)
        expect(card_b.locator('[data-fact="supervisor"]')).to_have_text("exited", timeout=15_000)
        expect(card_b.locator("a.dashboard")).to_have_count(0)

        card_a.locator("a.view").click()  # a's own view, served from its journal by this server
        expect(page.locator("#state")).to_have_text("running")
        expect(page.locator("#batch")).to_have_text("4 × 16 = 64")
        expect(page.locator("#attempts tbody tr")).to_have_count(3)
        expect(page.locator("#live")).to_have_text("live")
        assert page.url.startswith(fleet.url + "runs/")
        page.locator("#all-runs").click()
        expect(cards).to_have_count(3)
        assert page.url == fleet.url
        assert errors == []
    finally:
        fleet.stop()


def test_dashboard_shows_a_glob_that_matches_nothing_and_exits_as_status_words_them(page: Any, tmp_path: Path) -> None:
    """The run's --checkpoint glob is ckpt/step-*.pt; this worker writes elsewhere/step-N.pt."""
    run = start_run(tmp_path, env={"CKPT_DIR": str(tmp_path / "elsewhere"), "CKPT_EVERY": "5", "CKPT_TORCH": "1"})
    try:
        run.wait_for(lambda d: bool(d["warnings"]), timeout=30)
        page.goto(run.url)
        expect = sync_api.expect
        expect(page.locator("#warnings")).to_be_visible()
        expect(page.locator("#warnings")).to_contain_text("matches nothing, but the script wrote elsewhere/step-")
        expect(page.locator("#warnings")).to_contain_text("use --checkpoint 'elsewhere/step-*.pt'")
        expect(page.locator("#attempts tbody tr")).to_have_count(3)
        expect(page.locator("#attempts tbody")).to_contain_text("exit 1")  # as status and the report say it
    finally:
        run.stop()


def test_dashboard_shows_the_global_batch_a_script_without_accumulation_trains_at(page: Any, tmp_path: Path) -> None:
    """--batch-size {micro_batch} alone, halved under --allow-smaller-global-batch: 16 and 8 OOM, 4 trains."""
    run = start_run(tmp_path, micro=16, global_batch=16, extra=("--allow-smaller-global-batch",),
                    command=(sys.executable, str(WORKER), "--batch-size", "{micro_batch}"))
    try:
        run.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4)
        page.goto(run.url)
        expect = sync_api.expect
        expect(page.locator("#batch")).to_have_text("4 × 1 = 4 (asked 16)")
        expect(page.locator("#attempts tbody tr")).to_have_count(3)
        rows = page.locator("#attempts tbody tr")  # newest first
        expect(rows.nth(0).locator("td").nth(2)).to_have_text("4 × 1 = 4 (asked 16)")
        expect(rows.nth(2).locator("td").nth(2)).to_have_text("16 × 1 = 16")  # the batch asked for, kept
    finally:
        run.stop()
