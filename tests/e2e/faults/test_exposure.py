"""The dashboard on a network address, under a low file limit, and what it serves."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import ROOT, oomguard

from oomguard.supervisor.record.journal import Journal
from oomguard.web.exposure import public_urls
from oomguard.web.server import start_server

WORKER = str(Path(__file__).with_name("worker.py"))
RUN = ["--micro-batch", "1", "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2"]
SECRET = "sk-very-secret-123"


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run whose command line and log carry secrets."""
    run_dir = tmp_path_factory.mktemp("secret") / "run"
    out = oomguard("run", "--run-dir", str(run_dir), "--no-web", *RUN, "--", "sh", "-c",
                   f"echo starting with --api-key {SECRET} HF_TOKEN={SECRET}", "sh", "--api-key", SECRET,
                   f"WANDB_API_KEY={SECRET}", "{micro_batch}")
    assert out.returncode == 0, out.stderr
    return run_dir


def test_a_network_bind_needs_the_token_for_reads_and_hides_secrets(secret_run: Path) -> None:
    web = start_server(secret_run, None, "0.0.0.0", 0, token="tok-123")
    try:
        port = web.url.rstrip("/").rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=10, follow_redirects=False) as client:
            for path in ("/api/status", "/api/attempts", "/api/attempts/1/log", "/metrics", "/", "/api/stream",
                         "/api/openapi.json", "/healthz/", "/healthz/x", "/HEALTHZ"):
                assert client.get(path).status_code == 401, path
            assert client.post("/api/control/stop").status_code == 401
            assert client.get("/api/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert client.get("/static/app.js").status_code == 200  # the page's code holds nothing of the run
            link = client.get("/?token=tok-123")
            assert link.status_code == 303 and "HttpOnly" in link.headers["set-cookie"]
            assert "SameSite=Strict" in link.headers["set-cookie"]
            status = client.get("/api/status")  # the cookie the link set
            assert status.status_code == 200
            body = status.text + client.get("/api/attempts").text + client.get("/api/attempts/1/log").text
            assert SECRET not in body and "***" in body, body
        assert httpx.get(base + "/api/status", headers={"Authorization": "Bearer tok-123"}).status_code == 200
    finally:
        web.stop()


def test_on_a_network_bind_healthz_alone_answers_without_the_token(secret_run: Path) -> None:
    """Docker's HEALTHCHECK and Kubernetes probes carry no token; they learn only that the server is up."""
    web = start_server(secret_run, None, "0.0.0.0", 0, token="tok-123")
    try:
        base = "http://127.0.0.1:" + web.url.rstrip("/").rsplit(":", 1)[1]
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "oomguard_token=wrong"}):
            anonymous = httpx.get(base + "/healthz", headers=auth, timeout=10)
            assert anonymous.status_code == 200, auth
            assert anonymous.json() == {"ok": True, "state": None, "supervisor_alive": False}, auth
        known = httpx.get(base + "/healthz", headers={"Authorization": "Bearer tok-123"}, timeout=10)
        assert known.json() == {"ok": True, "state": "succeeded", "supervisor_alive": False}
        assert httpx.get(base + "/metrics", timeout=10).status_code == 401  # the next path over stays closed
    finally:
        web.stop()


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", "::1"])
def test_every_loopback_bind_checks_the_host_header(bind: str, secret_run: Path) -> None:
    if ":" in bind and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        web = start_server(secret_run, None, bind, 0, token="t")
    except Exception as exc:  # ::1 may be unconfigured in a container
        pytest.skip(f"cannot bind {bind}: {exc}")
    try:
        with httpx.Client(base_url=web.url, timeout=10) as client:
            assert client.get("/api/status").status_code == 200
            assert client.get("/api/status", headers={"Host": "evil.example:8765"}).status_code == 400
            assert client.get("/api/status", headers={"Host": "localhost"}).status_code == 200
    finally:
        web.stop()


def test_a_hard_link_out_of_the_run_dir_is_not_served(secret_run: Path, tmp_path: Path) -> None:
    outside = tmp_path / "private.txt"
    outside.write_text("not for the dashboard\n")
    link = secret_run / "logs" / "attempt-77.log"
    os.link(outside, link)
    web = start_server(secret_run, None, "127.0.0.1", 0, token="t")
    try:
        assert httpx.get(web.url + "api/attempts/77/log", timeout=10).status_code == 404
    finally:
        web.stop()
        link.unlink()


def test_400_idle_connections_under_a_low_file_limit_do_not_end_supervision(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 600:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    run_dir = tmp_path / "run"
    sup = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--port", "0",
                            *RUN, "--", sys.executable, WORKER, "crash_once", "--seconds", "4", "--after", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)},
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
    idle: list[socket.socket] = []
    try:
        url = _web_url(run_dir)
        host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
        for _ in range(400):
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect((host, int(port)))
            except OSError:
                s.close()
                continue
            idle.append(s)
        _, err = sup.communicate(timeout=90)
    finally:
        for s in idle:
            s.close()
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    attempts = Journal(run_dir, readonly=True).attempts()
    assert [a["kind"] for a in attempts] == ["crash", None], "the second attempt could not be started"


def _web_url(run_dir: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "token").exists() and (url := Journal(run_dir, readonly=True).meta().get("web_url")):
            return str(url)
        time.sleep(0.05)
    raise AssertionError("the dashboard never started")


def test_redaction_hides_values_not_lookalikes() -> None:
    from oomguard.web import exposure as redact

    words = ["python", "train.py", "--api-key", "k1", "--tokenizer", "gpt2", "--hf-token=k2", "HF_TOKEN=k3",
             "DB_PASSWORD=k4", "--lr", "3e-4", "--key_padding", "x", "AWS_ACCESS_KEY_ID=k5"]
    shown = redact.argv(words)
    assert "k1" not in shown and "--hf-token=***" in shown and "HF_TOKEN=***" in shown and "DB_PASSWORD=***" in shown
    assert shown[4:6] == ["--tokenizer", "gpt2"] and shown[9:11] == ["--lr", "3e-4"]
    assert shown[-1] == "AWS_ACCESS_KEY_ID=***" and "k5" not in redact.text("env AWS_ACCESS_KEY_ID=k5 ok")
    line = "export WANDB_API_KEY=abc; step 3 tokens/s 100"
    assert redact.text(line) == "export WANDB_API_KEY=***; step 3 tokens/s 100"


def test_a_network_bind_warns_and_prints_the_link_once_without_the_token_where_others_read(tmp_path: Path) -> None:
    """stderr is a pipe here, as in a Slurm output file (mode 0644) or a container log: the warning names
    the token file (mode 0600) and never the token (issue 37)."""
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--host", "0.0.0.0", "--port", "0", *RUN, "--",
                   "sh", "-c", "sleep 0.5", "sh", "{micro_batch}")
    assert out.returncode == 0, out.stderr
    token = (tmp_path / "run" / "token").read_text().strip()
    assert out.stderr.count("WARNING: the dashboard listens on 0.0.0.0") == 1, out.stderr
    assert token not in out.stderr, out.stderr
    warning = [line for line in out.stderr.splitlines() if "WARNING: the dashboard listens" in line]
    assert "?token=TOKEN" in warning[0] and f"{tmp_path / 'run' / 'token'} (readable by you only" in warning[0]
    assert (tmp_path / "run" / "token").stat().st_mode & 0o777 == 0o600
    # every link printed is one a person on another machine can open: the machine's name or addresses
    links = re.findall(r"http://[^\s,)?]+", out.stderr)
    assert links and not any(host in link for link in links for host in ("127.0.0.1", "localhost")), out.stderr
    assert f"{public_urls('0.0.0.0', 1)[0].rsplit(':', 1)[0]}:" in links[0]
