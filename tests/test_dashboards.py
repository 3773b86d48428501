"""The Grafana dashboard (docker/grafana/qwen-embed.json) and the Prometheus alert rules
(docker/prometheus/alerts.yaml) ask for series the deployment serves: every query parses as
PromQL, and every metric and label it names is in the /metrics of a real tritonserver and
gateway that answered requests (a renamed metric or label would leave a panel empty, an alert
silent)."""

import json
from pathlib import Path

import promql_parser
import pytest
import yaml

from qwen_embed_deploy.triton import scrape

from triton_helpers import GPU_ONLY_SERIES, gateway_process, post_json

DOCKER = Path(__file__).resolve().parents[1] / "docker"
DASHBOARD = DOCKER / "grafana" / "qwen-embed.json"
ALERTS = DOCKER / "prometheus" / "alerts.yaml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
# Grafana's variables, as a query of the dashboard sends them.
VARIABLES = {"$__rate_interval": "5m", "$model": ".*", "$key": ".*"}


def dashboard_queries() -> list[str]:
    """Every panel's PromQL, Grafana's variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    for name, value in VARIABLES.items():
        exprs = [e.replace(name, value) for e in exprs]
    return exprs


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return [rule["expr"] for rule in rules]


def selectors(expr) -> list[tuple[str, set[str], set[str]]]:
    """(metric, labels its matchers name, labels an enclosing `by` asks of it) of each series
    selector in a parsed PromQL expression."""
    if isinstance(expr, promql_parser.VectorSelector):
        return [(expr.name, {m.name for m in expr.matchers.matchers}, set())]
    if isinstance(expr, promql_parser.MatrixSelector):
        return selectors(expr.vector_selector)
    if isinstance(expr, promql_parser.AggregateExpr):
        grouped = set(expr.modifier.labels) if expr.modifier is not None else set()
        inner = selectors(expr.expr)
        return [(name, matched, asked | grouped) for name, matched, asked in inner]
    if isinstance(expr, promql_parser.BinaryExpr):
        return selectors(expr.lhs) + selectors(expr.rhs)
    if isinstance(expr, promql_parser.Call):
        return [s for arg in expr.args for s in selectors(arg)]
    if isinstance(expr, (promql_parser.ParenExpr, promql_parser.UnaryExpr)):
        return selectors(expr.expr)
    if isinstance(expr, (promql_parser.NumberLiteral, promql_parser.StringLiteral)):
        return []
    raise AssertionError(f"a PromQL node this test does not read: {type(expr).__name__}")


def served_series(server) -> dict[str, set[str]]:
    """Each series name of the server's and a gateway's /metrics as Prometheus stores it, with
    its label names, after the gateway answered, refused and passed on requests of each kind."""
    with gateway_process(server) as base:
        for path, body, status in [
            ("/v1/embeddings", {"model": "embed", "input": ["a text", "another"]}, 200),
            ("/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 0}, 400),
            ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a", "b"]}, 200),
        ]:
            assert post_json(base + path, body)[0] == status, path
        samples = [*scrape(f"{base}/metrics"), *scrape(server.metrics_url)]
    series: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        series.setdefault(name, set()).update(labels)
    return series


@pytest.mark.server  # starts tritonserver and a gateway
def test_every_series_the_dashboard_and_alerts_ask_for_is_served(server):
    series = served_series(server)
    queries = dashboard_queries() + alert_queries()
    assert len(queries) >= 20
    asked = set()
    for query in queries:
        for name, matched, grouped in selectors(promql_parser.parse(query)):
            asked.add(name)
            if name in GPU_ONLY_SERIES:
                continue
            assert name in series, (name, query)
            assert matched | grouped <= series[name] | {"le"}, (name, query, series[name])
            if "le" in grouped:  # a quantile reads a histogram's buckets
                assert name.endswith("_bucket") and "le" in series[name], (name, query)
    # each family of the gateway's and the encoder's metrics is on the dashboard
    for family in [
        "qwen_embed_gateway_requests_total",
        "qwen_embed_gateway_request_duration_seconds_bucket",
        "qwen_embed_gateway_tokens_total",
        "qwen_embed_gateway_batch_lines_total",
        "qwen_embed_tokens_total",
        "qwen_embed_encode_seconds_bucket",
        "nv_inference_queue_duration_us",
    ]:
        assert family in asked, family


def test_the_dashboards_variables_and_panels_are_grafanas():
    """What Grafana reads on import: a Prometheus data-source variable every panel and query
    uses, the model and API-key variables from served labels, unique panel ids, a grid
    position each."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for label in ("model", "key"):
        assert variables[label]["definition"] == (
            f"label_values(qwen_embed_gateway_requests_total, {label})"
        )
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]
        for source in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_each_alert_says_what_and_how_bad():
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "QwenEmbedServerErrors",
        "QwenEmbedOverloaded",
        "QwenEmbedSlow",
    ]
    for rule in rules:
        promql_parser.parse(rule["expr"])
        assert rule["for"].endswith("m") and rule["labels"]["severity"] in ("page", "ticket")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_prometheus_config_scrapes_both_ports_and_loads_the_alerts():
    """docker/prometheus/prometheus.yml scrapes the ports compose publishes for Triton's
    metrics and the gateway (the Makefile's defaults too), and its rule file is the alerts."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert [PROMETHEUS.parent / f for f in config["rule_files"]] == [ALERTS]
    targets = {
        job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
        for job in config["scrape_configs"]
    }
    published = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["qwen-embed"]
    ports = {p.split(":")[-1] for p in published["ports"]}
    makefile = (DOCKER.parent / "Makefile").read_text()
    for job, variable in [
        ("qwen-embed-triton", "METRICS_PORT"),
        ("qwen-embed-gateway", "GATEWAY_PORT"),
    ]:
        (target,) = targets[job]
        port = target.split(":")[1]
        assert port in ports and f"{variable} ?= {port}" in makefile, (job, target)


def test_the_pod_monitor_scrapes_both_ports_of_the_deployments_pods():
    """docker/prometheus/podmonitor.yaml selects the Kubernetes Deployment's pods and scrapes,
    by the container's port names, the two ports prometheus.yml scrapes on one host: Triton's
    metrics and the gateway's (which the image serves: its default command)."""
    monitor = yaml.safe_load((DOCKER / "prometheus" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    pod = yaml.safe_load((DOCKER / "k8s" / "deployment.yaml").read_text())["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert all(e["path"] == "/metrics" for e in endpoints)
    scraped = sorted(ports[e["port"]] for e in endpoints)
    config = yaml.safe_load(PROMETHEUS.read_text())
    on_a_host = [
        t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    ]
    assert scraped == sorted(int(t.split(":")[1]) for t in on_a_host) == [8002, 8080]
    assert '--gateway-port", "8080"' in (DOCKER / "Dockerfile").read_text()
