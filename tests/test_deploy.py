"""Files under deploy/ parse and agree with the code they describe."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from baton.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _serve_default(flag: str):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return next(a.default for a in serve._actions if flag in a.option_strings)


def test_prometheus_config_scrapes_the_default_metrics_ports():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in cfg["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    base = _serve_default("--metrics-port")
    assert [int(t.rsplit(":", 1)[1]) for t in targets] == [base, base + 1, base + 2]


def test_observability_doc_names_real_spans_flags_and_metrics():
    doc = (DEPLOY / "observability.md").read_text()
    code = "".join(p.read_text() for p in [*(ROOT / "services").rglob("*.py"), ROOT / "baton" / "metrics.py"])
    names = set(re.findall(r"`(baton\.[a-z_.]+)`", doc))
    assert len(names) > 10
    for name in names:  # span and attribute names, as the code spells them
        assert f'"{name}"' in code, name
    for flag in ("--otlp-endpoint", "--metrics-port"):
        assert flag in doc and flag in (ROOT / "baton" / "cli.py").read_text()
    for metric in re.findall(r"`(baton:[a-z_]+)", doc):
        assert metric.removesuffix("_total") in code, metric
