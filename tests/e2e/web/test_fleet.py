"""``oomguard dashboard DIR...``: the many-runs page's API and its exposure rules, on a real server
(its own process) over real runs: one alive, one finished, a damaged journal."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import OOMGUARD, REPO, Fleet, Run, start_fleet

from oomguard.web.fleet import run_key


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, live_run: Run) -> Iterator[tuple[Fleet, Path]]:
    """A directory of runs: the session's live run (linked in), a finished one, a damaged journal."""
    import subprocess

    root = tmp_path_factory.mktemp("machine")
    (root / "live").symlink_to(live_run.run_dir, target_is_directory=True)  # not followed: given as a root too
    done = subprocess.run([*OOMGUARD, "run", "--run-dir", str(root / "exp" / "done"), "--no-web", "--micro-batch",
                           "2", "--grad-accum", "1", "--", "true", "{micro_batch}"], cwd=REPO, capture_output=True,
                          text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    damaged = root / "exp" / "broken" / "journal.sqlite"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"\0" * 4096)
    os.utime(damaged, (time.time() - 600, time.time() - 600))
    fleet = start_fleet(root, root, live_run.run_dir)
    try:
        yield fleet, root
    finally:
        started = time.monotonic()
        assert fleet.stop() == -15  # uvicorn shuts down, then ends by the signal it was sent
        assert time.monotonic() - started < 5


def test_lists_every_run_from_the_journals(machine: tuple[Fleet, Path], live_run: Run) -> None:
    fleet, root = machine
    rows = {r["name"]: r for r in fleet.runs()}
    assert set(rows) == {"exp/done", "exp/broken", "run"}, rows  # the symlink is not followed
    live = rows["run"]
    assert live["state"] == "running" and live["supervisor"] == "alive" and live["dashboard"] == live_run.url
    assert live["key"] == run_key(live_run.run_dir.resolve()) and live["view"] == f"runs/{live['key']}/"
    assert rows["exp/done"]["state"] == "succeeded" and rows["exp/done"]["supervisor"] == "exited"
    assert rows["exp/broken"]["state"] == "damaged" and "cannot be read" in rows["exp/broken"]["error"]
    page = fleet.get("/")
    assert page.status_code == 200 and "static/fleet.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_each_run_has_its_own_read_only_view(machine: tuple[Fleet, Path], live_run: Run) -> None:
    fleet, root = machine
    done = next(r for r in fleet.runs() if r["name"] == "exp/done")
    view = fleet.get(done["view"] + "api/status").json()
    assert view["state"] == "succeeded" and view["run_dir"] == done["run_dir"]
    assert fleet.get(done["view"]).text == httpx.get(live_run.url).text  # the run dashboard's own page
    assert fleet.get(done["view"] + "static/app.js").status_code == 200
    redirect = httpx.get(fleet.url + done["view"].rstrip("/"), follow_redirects=False)
    assert redirect.status_code in (307, 308) and redirect.headers["location"].endswith(done["view"])
    assert fleet.get(done["view"] + "metrics").text.startswith("# HELP oomguard_")
    assert fleet.get("runs/0123456789ab/api/status").status_code == 404
    assert fleet.get("runs/..%2F..%2Fetc/api/status").status_code == 404


def test_control_is_not_served_here(machine: tuple[Fleet, Path]) -> None:
    fleet, _ = machine
    view = next(r for r in fleet.runs() if r["name"] == "run")["view"]
    assert httpx.post(fleet.url + view + "api/control/stop", timeout=10).status_code == 401
    refused = httpx.post(fleet.url + view + "api/control/stop", headers={"Authorization": "Bearer x"}, timeout=10)
    assert refused.status_code == 403 and "disabled" in refused.json()["detail"]


def test_loopback_checks_the_host_header(machine: tuple[Fleet, Path]) -> None:
    fleet, _ = machine
    assert fleet.get("api/runs", headers={"Host": "evil.example:8760"}).status_code == 400
    assert fleet.get("api/runs", headers={"Host": "localhost"}).status_code == 200


def test_a_network_bind_needs_the_printed_token(tmp_path: Path, live_run: Run) -> None:
    fleet = start_fleet(tmp_path, live_run.run_dir, host="0.0.0.0")
    try:
        said = fleet.stderr_path.read_text()
        assert "WARNING: listening on 0.0.0.0" in said and "?token=" in said
        token = said.split("?token=", 1)[1].split()[0]
        with httpx.Client(base_url=fleet.url, timeout=10, follow_redirects=False) as client:
            for path in ("/", "/api/runs", "/metrics"):
                assert client.get(path).status_code == 401, path
            assert client.get("/healthz").status_code == 200  # probes need no token; it reveals nothing
            link = client.get(f"/?token={token}")
            assert link.status_code == 303 and "HttpOnly" in link.headers["set-cookie"]
            assert len(client.get("/api/runs").json()["runs"]) == 1  # the cookie the link set
        assert fleet.get("api/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    finally:
        fleet.stop()


def test_bad_directories_are_one_line(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run([*OOMGUARD, "dashboard", str(tmp_path / "nope")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "is not a directory" in out.stderr


def test_a_live_run_on_a_network_bind_is_linked_at_an_address_others_open(tmp_path: Path) -> None:
    """ls and the many-runs page give the address others open (not 127.0.0.1, which answers 401 on a
    network bind); where the page is itself behind its token (a network bind) its link carries the run's
    token, so it opens instead of answering 401; on loopback, which any local account can open, it does not."""
    import psutil

    from oomguard.supervisor.record.journal import Journal
    from oomguard.supervisor.record.status import summarize
    from oomguard.web.fleet import Runs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    journal = Journal(run_dir)
    journal.set_meta(state="running", supervisor_pid=os.getpid(), supervisor_started=psutil.Process().create_time(),
                     web_url="http://127.0.0.1:8765/", web_public=["http://gpu7:8765/", "http://10.0.0.7:8765/"])
    journal.close()
    (run_dir / "token").write_text("tok-1\n")
    assert summarize(run_dir)["dashboard"] == "http://gpu7:8765/"
    assert Runs([tmp_path], guarded=True).rows()[0]["dashboard"] == "http://gpu7:8765/?token=tok-1"
    assert Runs([tmp_path]).rows()[0]["dashboard"] == "http://gpu7:8765/"
