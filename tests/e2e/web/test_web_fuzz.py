"""Fuzz every operation of the OpenAPI schema against the live server: never a 5xx.

Hypothesis drives schemathesis' strategies directly (bounded examples per operation) so the test
can target the server the session fixture started. The control endpoints are fuzzed too, without
a token: they must answer 401/403 and leave the run alone.
"""

from __future__ import annotations

import pytest
from harness import Run

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = 25
SKIP = {"/api/stream"}  # an endless response; covered by test_api


def test_openapi_schema_fuzz_has_no_server_errors(live_run: Run) -> None:
    schema = schemathesis.openapi.from_url(live_run.url + "api/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [op for op in operations if op.path not in SKIP]
    assert {op.path for op in fuzzed} >= {"/api/status", "/api/attempts/{attempt}/log", "/api/samples",
                                           "/api/control/stop"}
    before = live_run.status()
    calls = sum(_fuzz(operation, live_run.url.rstrip("/")) for operation in fuzzed)
    assert calls >= 3 * len(fuzzed)
    after = live_run.status()
    assert (after["attempt"], after["worker_pid"]) == (before["attempt"], before["worker_pid"])


def _fuzz(operation: object, base_url: str) -> int:
    calls = []

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy())  # type: ignore[attr-defined]
    def check(case: object) -> None:
        response = case.call(base_url=base_url, timeout=10)  # type: ignore[attr-defined]
        calls.append(response.status_code)
        assert response.status_code < 500, f"{case}: {response.status_code} {response.text[:300]}"
        if "/api/control/" in operation.path:  # type: ignore[attr-defined]
            assert response.status_code in (401, 403), response.status_code

    check()
    return len(calls)
