"""docs/deploy/grafana-oomguard.json charts only what /metrics really exports, and the scrape config
beside it points Prometheus at it: checked against the /metrics of a real supervised run."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import yaml
from harness import REPO, Run
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = REPO / "docs" / "deploy"
METRIC = re.compile(r"\boomguard_[a-z_]+\b")


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _exported(run: Run, wanted: set[str]) -> set[str]:
    """Family and sample names of real scrapes (a counter family ``x`` is sampled as ``x_total``), once the
    run has trained past its OOMs, reported progress and written a checkpoint. A figure the worker
    reports comes and goes between scrapes (its progress record and its output race), so scrapes go on
    for a few seconds until every wanted name was seen once."""
    run.wait_for(lambda d: bool(d["progress"] and d["newest_checkpoint"] and d["failures"]))
    names: set[str] = set()
    deadline = time.monotonic() + 10
    while not wanted <= names and time.monotonic() < deadline:
        response = run.get("metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        for family in text_string_to_metric_families(response.text):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
        time.sleep(0.2)
    return names


def test_every_query_names_a_metric_that_metrics_exports(live_run: Run) -> None:
    dashboard = json.loads((DEPLOY / "grafana-oomguard.json").read_text())
    queries = _queries(dashboard)
    exported = _exported(live_run, {name for query in queries for name in METRIC.findall(query)})
    assert len(queries) >= 12
    used: set[str] = set()
    for query in queries:
        names = set(METRIC.findall(query))
        assert names, f"names no oomguard metric: {query}"
        assert names <= exported, f"{sorted(names - exported)} are not in /metrics ({sorted(exported)})"
        used |= names
    assert {"oomguard_state", "oomguard_restarts_total", "oomguard_worker_rss_bytes", "oomguard_step",
            "oomguard_micro_batch", "oomguard_samples_per_second"} <= used
    labels = {"state", "kind", "device", "rank", "instance"}
    for query in queries:  # a label a query groups or filters by is one the metric has (or Prometheus adds)
        for label in re.findall(r"\bby \(([^)]*)\)", query):
            assert {w.strip() for w in label.split(",")} <= labels, query


def test_the_dashboard_is_importable(live_run: Run) -> None:
    dashboard = json.loads((DEPLOY / "grafana-oomguard.json").read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36 and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance"}


def test_the_scrape_config_points_at_metrics(live_run: Run) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    assert {job["metrics_path"] for job in jobs} == {"/metrics"}
    assert all(re.fullmatch(r"[\w.-]+:\d+", t) for job in jobs for s in job["static_configs"] for t in s["targets"])
    assert jobs[0]["static_configs"][0]["targets"] == ["127.0.0.1:8765"]  # the dashboard's default address
    port = live_run.url.rstrip("/").rsplit(":", 1)[1]
    assert live_run.get(jobs[0]["metrics_path"]).status_code == 200, port
    remote = next(job for job in jobs if "authorization" in job)
    authorization = remote["authorization"]
    assert authorization["type"] == "Bearer" and authorization["credentials_file"].endswith("/token")
