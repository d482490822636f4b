"""What real tools see, checked with the tools themselves:

- Debian's `prometheus`, started with deploy/prometheus.yml against a `baton serve` on its default ports, stores
  every metric deploy/observability.md lists under the name listed there (and none under another spelling);
- every query of the Grafana dashboard (deploy/grafana-dashboard.json) returns data from that Prometheus;
- a launcher killed with SIGKILL leaves no process and no temporary folder behind, and a new one starts on the
  same ports; one stopped with SIGTERM leaves nothing either.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from baton import metrics
from baton.api.client import Client, generate_request
from baton.cli import build_parser
from baton.loader import load_model
from baton.model.lora import write_random_adapter
from baton.services.redis_server import free_port
from tests.serve_process import serve_process, stop_process

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
PROMETHEUS = "prometheus"  # Debian's package, installed by scripts/setup.sh --test
ADAPTER = "realtools-lora"
ENV_DROP = ("BATON_TOKEN", "BATON_REDIS_URL", "BATON_GATEWAY_KEY", "BATON_AUTH_TOKENS", "RAY_ADDRESS")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ENV_DROP}


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """deploy/observability.md's table: name -> (type, the labels each series carries)."""
    doc = (DEPLOY / "observability.md").read_text()
    rows = re.findall(r"^\| `(baton_\w+)` \| (histogram|counter|gauge) \| ([^|]*)\|", doc, flags=re.M)
    out = {}
    for name, kind, extra in rows:
        labels = set(re.findall(r"`(\w+)`", extra))
        out[name] = (kind, labels if "no model, worker" in extra else labels | {"model", "worker"})
    return out


def stored_names(name: str, kind: str) -> list[str]:
    """The series names Prometheus stores for one documented metric."""
    return [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]


# ---- without a stack ----------------------------------------------------------------------------------------


def test_the_doc_lists_every_metric_baton_defines_by_its_stored_name():
    from prometheus_client import REGISTRY

    defined = {}
    for family in REGISTRY.collect():
        if family.name.startswith("baton"):
            defined[family.name + ("_total" if family.type == "counter" else "")] = family.type
    documented = documented_metrics()
    assert len(documented) >= 25
    assert {n: k for n, (k, _) in documented.items()} == defined
    assert all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", n) for n in defined)  # nothing a scraper would rewrite


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_the_dashboard_is_an_importable_grafana_dashboard():
    d = _dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = _variables(d)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    # What the issue asks to see, each in some panel's query.
    exprs = " ".join(e for _, e in _queries(d))
    for metric in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "generation_tokens",
                   "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits", "kv_transfer_bytes",
                   "kv_transfer_seconds", "batch_size", "request_queue_time"):
        assert f"baton_{metric}" in exprs, metric
    # Every metric a query names is one Baton stores.
    stored = {s for n, (k, _) in documented_metrics().items() for s in stored_names(n, k)}
    assert set(re.findall(r"\bbaton_\w+", exprs)) <= stored
    # The SLO choices are bucket bounds of the histograms they cut (else the query finds no bucket).
    for var, histogram in (("slo_ttft", metrics.TTFT), ("slo_itl", metrics.ITL)):
        bounds = {str(float(b)) for b in histogram._upper_bounds}  # the `le` values prometheus_client writes
        options = {o["value"] for o in variables[var]["options"]}
        assert options and options <= bounds, (var, options - bounds)
        assert variables[var]["current"]["value"] in options


# ---- a baton serve on its default ports, and Debian's Prometheus on deploy/prometheus.yml --------------------


def _serve_defaults() -> dict[str, int]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {a.option_strings[0]: int(a.default) for a in serve._actions
            if a.option_strings and a.option_strings[0] in ("--port", "--metrics-port", "--http-port")}


def _prometheus_binary() -> str:
    binary = shutil.which(PROMETHEUS)
    if binary is None:
        pytest.fail("prometheus is not installed (Debian: apt-get install prometheus; scripts/setup.sh --test does)",
                    pytrace=False)
    return binary


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_path):
    """`baton serve` with the ports deploy/prometheus.yml scrapes (its defaults), and requests flowing through it
    (gRPC and HTTP, plain and structured, a repeated prompt for prefix hits) until the module ends."""
    ports = _serve_defaults()
    busy = [p for p in ports.values() if p > 0 and _listening(p)]
    assert not busy, f"ports {busy} are taken on this machine; deploy/prometheus.yml scrapes baton serve's defaults"
    folder = tmp_path_factory.mktemp("served")
    log_path = folder / "serve.log"
    # One LoRA adapter, so that its per-adapter series exist too.
    adapter = write_random_adapter(folder / "adapter", load_model(default_model_path, weights=False).config, 4,
                                   ["q_proj", "v_proj"])
    # Speculation on: its per-position series exist only then (and plain, LoRA and structured requests go through it).
    argv = [sys.executable, "-m", "baton.cli", "serve", "--kv-cache-memory", "0.25", "--lora", f"{ADAPTER}={adapter}",
            "--speculative", "ngram"]
    with serve_process(argv, _env(), log_path) as (proc, address):
        stop = threading.Event()
        errors: list[BaseException] = []
        traffic = threading.Thread(target=_traffic, args=(address, ports["--http-port"], stop, errors), daemon=True)
        traffic.start()
        try:
            yield address
        finally:
            stop.set()
            traffic.join(timeout=120)
        assert not errors, errors


def _listening(port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.net_connections("tcp"))


def _traffic(address: str, http_port: int, stop: threading.Event, errors: list) -> None:
    import openai

    prompt = "Here is a list of the planets of the solar system, from the closest to the sun to the farthest one:"
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
    model = None
    try:
        with Client(address) as client:
            while not stop.is_set():
                client.complete(generate_request(prompt, sampling={"max_tokens": 8, "temperature": 0}), timeout=120)
                client.complete(generate_request(prompt, sampling={"max_tokens": 4}, adapter=ADAPTER), timeout=120)
                model = model or oai.models.list().data[0].id
                oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                            max_tokens=6)
                oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object?"}],
                                            max_tokens=12, response_format={"type": "json_object"})
    except BaseException as e:  # noqa: BLE001 - reported by the fixture
        errors.append(e)


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    """Debian's prometheus with deploy/prometheus.yml as it is, on a free loopback port: its HTTP API's base URL."""
    binary = _prometheus_binary()
    folder = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    log = open(folder / "prometheus.log", "w")  # noqa: SIM115 - closed after the process
    proc = subprocess.Popen([binary, f"--config.file={DEPLOY / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus did not get ready"
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _api(url: str, path: str, **params: str) -> dict:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=30) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def _until(check, timeout_s: float, what: str):
    """Poll ``check`` (returns (done, detail)) until done; fail with the last detail past the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, detail = check()
        if done:
            return detail
        assert time.monotonic() < deadline, f"{what}: {detail}"
        time.sleep(1)


@pytest.mark.slow
def test_prometheus_stores_every_documented_metric_under_its_documented_name(prometheus):
    def targets_up():
        active = _api(prometheus, "targets")["activeTargets"]
        return len(active) == 3 and all(t["health"] == "up" for t in active), [
            (t["scrapeUrl"], t["health"], t.get("lastError")) for t in active]

    _until(targets_up, 120, "not every target of deploy/prometheus.yml is up")
    documented = documented_metrics()

    def all_stored():
        missing = {}
        for name, (kind, _) in documented.items():
            for series_name in stored_names(name, kind):
                if not _api(prometheus, "series", **{"match[]": f'{{__name__="{series_name}"}}'}):
                    missing[series_name] = kind
        return not missing, missing

    _until(all_stored, 120, "documented metrics that Prometheus has not stored")
    for name, (kind, labels) in documented.items():
        for series in _api(prometheus, "series", **{"match[]": f'{{__name__="{stored_names(name, kind)[0]}"}}'}):
            assert labels <= set(series), (name, series)
            assert series["job"] == "baton" and series["service"] in ("router", "prefill", "decode"), series
    # Each worker's own series, under the service label that deploy/prometheus.yml gives its port.
    workers = {(s["service"], s["worker"]) for s in _api(prometheus, "series",
                                                         **{"match[]": "baton_kv_cache_usage_perc"})}
    assert workers == {("prefill", "prefill-0"), ("decode", "decode-0")}
    # No name under another spelling: nothing with a colon, nothing outside the documented set.
    names = set(_api(prometheus, "label/__name__/values"))
    baton_names = {n for n in names if n.startswith("baton")}
    stored = {s for n, (k, _) in documented.items() for s in stored_names(n, k)}
    assert baton_names == stored, baton_names ^ stored
    assert not any(":" in n for n in names), [n for n in names if ":" in n]


def test_text_and_openmetrics_expositions_name_the_same_series():
    """What a plain GET /metrics reads and what a scraper that asks for OpenMetrics reads: the same names."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    metrics.start_series("test-model", "decode-9", "decode")
    text = {line.split("{")[0].split(" ")[0] for line in generate_latest(REGISTRY).decode().splitlines()
            if line.startswith("baton")}
    om = {line.split("{")[0].split(" ")[0] for line in generate_openmetrics(REGISTRY).decode().splitlines()
          if line.startswith("baton")}
    assert text and text == om


@pytest.mark.slow
def test_every_dashboard_query_returns_data(prometheus):
    """Each query of deploy/grafana-dashboard.json, with the dashboard's own variable values, returns at least one
    number from the Prometheus above while requests flow."""
    d = _dashboard()
    variables = _variables(d)
    values = {"$__rate_interval": "1m", "$slo_ttft": variables["slo_ttft"]["current"]["value"],
              "$slo_itl": variables["slo_itl"]["current"]["value"], "$model": ".*"}
    queries = []
    for title, expr in _queries(d):
        for var, value in values.items():
            expr = expr.replace(var, value)
        assert "$" not in expr.replace('"$1"', ""), (title, expr)  # every variable known (label_replace's $1 aside)
        queries.append((title, expr))

    def all_answer():
        empty = []
        for title, expr in queries:
            result = _api(prometheus, "query", query=expr)["result"]
            if not any(math.isfinite(float(r["value"][1])) for r in result):
                empty.append((title, expr, result))
        return not empty, empty

    _until(all_answer, 180, "dashboard queries without data")


# ---- a launcher that dies ---------------------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _folders(tree: list[psutil.Process]) -> list[Path]:
    """The stack's temporary folders: the private Redis's (its working directory) and the local Ray's."""
    folders = []
    for p in tree:
        cmd = " ".join(p.cmdline())
        if "redis-server" in cmd:
            folders.append(Path(p.cwd()))
        if m := re.search(r"--log_dir=(\S*?/baton-ray-[^/]+)/", cmd):
            folders.append(Path(m.group(1)))
    return sorted(set(folders))


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(tree: list[psutil.Process], timeout_s: float) -> None:
    _until(lambda: (not (left := [p for p in tree if _running(p)]), [p.pid for p in left]), timeout_s,
           "processes of the stack still run")


@pytest.mark.slow
def test_a_launcher_killed_by_sigkill_leaves_nothing_behind(tmp_path, default_model_path):
    ports = [free_port(), free_port(), free_port()]
    argv = [sys.executable, "-m", "baton.cli", "serve", "--port", str(ports[0]), "--metrics-port", str(ports[1]),
            "--http-port", str(ports[2]), "--kv-cache-memory", "0.25"]
    with serve_process(argv, _env(), tmp_path / "first.log") as (proc, address):
        tree = _tree(proc.pid)
        commands = " ".join(" ".join(p.cmdline()) for p in tree)
        for part in ("redis-server", "gcs_server", "raylet", "baton.reaper", "ray::PrefillWorker",
                     "ray::DecodeWorker"):
            assert part in commands, part
        folders = _folders(tree)
        assert len(folders) == 2 and all(f.is_dir() for f in folders), folders
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _gone(tree, 60)
        assert not [f for f in folders if f.exists()]
    # The same ports again: nothing holds them.
    with serve_process(argv, _env(), tmp_path / "second.log") as (proc, address):
        assert address.endswith(f":{ports[0]}")
        tree = _tree(proc.pid)
        folders = _folders(tree)
        with Client(address) as client:
            done = client.complete(generate_request("Hello", sampling={"max_tokens": 4, "temperature": 0}),
                                   timeout=120)
        assert len(done.token_ids) == 4
        stop_process(proc, signal.SIGTERM)  # and a clean stop leaves nothing either
        assert proc.returncode == 0
        _gone(tree, 60)
        assert not [f for f in folders if f.exists()]
