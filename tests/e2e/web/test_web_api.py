"""The REST API, the live stream and /metrics against a real server and a real supervised worker."""

from __future__ import annotations

import json
import stat
import time
from typing import Any

import httpx
import pytest
from harness import Run

BAD_LOG_PATHS = [
    "api/attempts/..%2F..%2F..%2Fetc%2Fpasswd/log",
    "api/attempts/%2Fetc%2Fpasswd/log",
    "api/attempts/1%2F..%2F..%2Ftoken/log",
    "api/attempts/../../token",
    "api/attempts/99999999999999999999999999/log",
    "api/attempts/1000001/log",
    "api/attempts/-1/log",
    "api/attempts/0/log",
    "api/attempts/1.5/log",
    "api/attempts/1e3/log",
    "api/attempts/1/log?lines=1000000000",
    "api/attempts/1/log?lines=-5",
]


def test_status_is_the_cli_document(live_run: Run) -> None:
    api = live_run.status()
    cli = live_run.cli("status", "--json")
    assert cli.returncode == 0, cli.stderr
    doc = json.loads(cli.stdout)
    for key in ("state", "attempt", "micro_batch", "grad_accum", "global_batch", "world_size", "failures"):
        assert doc[key] == api[key], key
    assert api["micro_batch"] * api["grad_accum"] == api["global_batch"] == 64
    assert [f["kind"] for f in api["failures"]] == ["cuda_oom", "cuda_oom"]
    assert "CUDA out of memory" in api["failures"][0]["evidence"]


def test_attempts_events_and_checkpoints(live_run: Run) -> None:
    attempts = live_run.get("api/attempts").json()
    assert [a["micro_batch"] for a in attempts[:3]] == [16, 8, 4]
    assert attempts[0]["kind"] == "cuda_oom" and "log_path" not in attempts[0]
    events = live_run.get("api/events", params={"since": 0, "limit": 1000}).json()
    assert any(e["kind"] == "decision" for e in events)
    later = live_run.get("api/events", params={"since": events[2]["id"]}).json()
    assert later[0]["id"] == events[3]["id"]
    live_run.wait_for(lambda d: d["newest_checkpoint"] is not None)
    checkpoints = live_run.get("api/checkpoints", params={"limit": 1}).json()
    assert len(checkpoints) == 1 and checkpoints[0]["path"].endswith(".pt")


def test_samples_downsampled_and_ranged(live_run: Run) -> None:
    deadline = time.monotonic() + 10
    while len(points := live_run.get("api/samples").json()["points"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.3)
    # A sample taken between two attempts has no worker to read (None, never a made-up 0)
    assert len(points) >= 4 and all(p["host_rss"] is None or p["host_rss"] > 0 for p in points)
    assert sum(p["host_rss"] is not None for p in points) >= 2
    small = live_run.get("api/samples", params={"max_points": 2}).json()
    assert len(small["points"]) <= 2 and small["total"] >= 4
    middle = points[len(points) // 2]["t"]
    later = live_run.get("api/samples", params={"start": middle}).json()["points"]
    assert later and all(p["t"] >= middle for p in later)
    bad = live_run.get("api/samples", params={"start": "nan"})
    assert bad.status_code == 422


def test_markers_show_ooms_restarts_and_batch_changes(live_run: Run) -> None:
    markers = live_run.get("api/markers").json()
    kinds = [m["kind"] for m in markers]
    assert kinds.count("oom") == 2 and kinds.count("restart") >= 2 and kinds.count("batch") >= 2
    assert markers == sorted(markers, key=lambda m: m["t"])


def test_log_tail_by_attempt_number(live_run: Run) -> None:
    tail = live_run.get("api/attempts/1/log", params={"lines": 50}).json()
    assert any("CUDA out of memory" in line for line in tail["lines"])
    assert live_run.get("api/attempts/3/log", params={"lines": 1}).json()["lines"]
    assert live_run.get("api/attempts/999/log").status_code == 404


@pytest.mark.parametrize("path", BAD_LOG_PATHS)
def test_log_requests_with_paths_or_huge_numbers_are_rejected(live_run: Run, path: str) -> None:
    response = live_run.get(path)
    assert response.status_code in (404, 422), response.text
    assert "root:" not in response.text and live_run.token not in response.text


def test_healthz_and_metrics(live_run: Run) -> None:
    assert live_run.get("healthz").json() == {"ok": True, "state": "running", "supervisor_alive": True}
    # The newest sample may fall between two attempts, with no worker to read, and a fresh attempt has no
    # rate before its first progress records: wait for a sample with both (run alone, the test came first)
    deadline = time.monotonic() + 30
    while not ("oomguard_worker_rss_bytes" in (text := live_run.get("metrics").text)
               and "oomguard_samples_per_second" in text) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert 'oomguard_state{state="running"} 1.0' in text
    assert "oomguard_micro_batch 4.0" in text and "oomguard_grad_accum 16.0" in text
    assert 'oomguard_restarts_total{kind="cuda_oom"} 2.0' in text
    assert "oomguard_worker_rss_bytes" in text and "oomguard_samples_per_second 40.0" in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    assert names and all(name.startswith("oomguard_") for name in names)


def _events_count(run: Run, kind: str) -> int:
    return sum(e["kind"] == kind for e in run.get("api/events", params={"limit": 1000}).json())


@pytest.mark.parametrize("headers, code", [
    ({}, 401),
    ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
    ({"Authorization": "Bearer"}, 401),
    ({"Authorization": "Bearer wrong-token"}, 403),
    ({"Authorization": "Bearer t\u00f6ken".encode()}, 403),
])
def test_control_without_the_token_is_refused_and_changes_nothing(live_run: Run, headers: dict[str, Any],
                                                                   code: int) -> None:
    before = live_run.status()
    requests_before = _events_count(live_run, "checkpoint_request")
    for action in ("checkpoint", "restart", "stop"):
        response = live_run.post(f"api/control/{action}", headers=headers)
        assert response.status_code == code, response.text
        if code == 401:
            assert response.headers["www-authenticate"] == "Bearer"
    time.sleep(0.3)  # the loop would act on a flag within a tick
    after = live_run.status()
    assert (after["state"], after["attempt"], after["worker_pid"]) == (
        before["state"], before["attempt"], before["worker_pid"])
    assert _events_count(live_run, "checkpoint_request") == requests_before


def test_token_file_is_private_and_never_logged(live_run: Run) -> None:
    mode = stat.S_IMODE((live_run.run_dir / "token").stat().st_mode)
    assert mode == 0o600
    assert len(live_run.token) >= 32
    assert live_run.token not in live_run.stderr_path.read_text()
    assert not list(live_run.run_dir.glob(".token*"))  # no temp file left behind


def test_checkpoint_request_reaches_the_loop_and_the_stream(live_run: Run) -> None:
    with httpx.stream("GET", live_run.url + "api/stream", timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("retry:")
        response = live_run.cli("checkpoint")
        assert response.returncode == 0, response.stderr
        seen = _read_until(lines, '"checkpoint_request"')
    assert "event: journal" in seen and "event: status" in seen


def _read_until(lines: object, needle: str, timeout: float = 10.0) -> str:
    text, deadline = "", time.monotonic() + timeout
    for line in lines:  # type: ignore[attr-defined]
        text += line + "\n"
        if needle in line or time.monotonic() > deadline:
            break
    assert needle in text, text
    return text


def test_stream_sends_samples(live_run: Run) -> None:
    with httpx.stream("GET", live_run.url + "api/stream", timeout=10) as stream:
        text = _read_until(stream.iter_lines(), "event: sample", timeout=5)
    assert "event: status" in text


def test_restart_and_stop_with_the_token(own_run: Run) -> None:
    first = own_run.status()
    auth = {"Authorization": f"Bearer {own_run.token}"}
    assert own_run.post("api/control/restart", headers=auth).status_code == 202
    own_run.wait_for(lambda d: d["attempt"] == first["attempt"] + 1 and d["state"] == "running")
    stop = own_run.cli("stop")
    assert stop.returncode == 0 and "stop requested" in stop.stdout
    assert own_run.proc.wait(timeout=20) != 0
    final = own_run.cli("status", "--json")
    assert json.loads(final.stdout)["state"] == "stopped"
    assert own_run.cli("checkpoint").returncode == 2  # one-line error: nothing to control
