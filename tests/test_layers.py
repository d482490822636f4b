"""Layers that import one way, and a request path without torch.

The layers, lowest first (a module may import its own layer and the ones below):

    request layer and leaves  baton.api, baton.config, baton.flags, baton.tokenizer, baton.detokenizer,
                              baton.grammar, baton.metrics, baton.tracing, baton.security, baton.reaper,
                              baton.v1
    kernels and memory        baton.kernels, baton.memory
    model and loading         baton.model, baton.loader
    engine                    baton.engine
    services                  baton.services
    launch and measure        baton.serve, baton.bench
    command line              baton.cli

Checked on the source with Python's own parser, every import statement counted, inside functions too.
import-linter (grimp) would be the library for this, but it walks the package folder and does not follow
the links through which the top-level services/ and kernels/ folders are baton.services and baton.kernels.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"baton": ROOT / "baton", "baton.services": ROOT / "services", "baton.kernels": ROOT / "kernels"}
LAYERS = [
    ("baton.api", "baton.config", "baton.flags", "baton.tokenizer", "baton.detokenizer", "baton.grammar",
     "baton.metrics", "baton.tracing", "baton.security", "baton.reaper", "baton.v1"),
    ("baton.kernels", "baton.memory"),
    ("baton.model", "baton.loader"),
    ("baton.engine",),
    ("baton.services",),
    ("baton.serve", "baton.bench"),
    ("baton.cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if prefix == "baton" and parts and parts[0] in ("services", "kernels"):
                continue  # the links; read from the real folders above
            out[".".join([prefix, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The baton modules ``name`` imports anywhere in its file (the longest known module of each import)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the package, less one part per extra dot
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items() if name != "baton"}


def test_every_import_goes_down_the_layers():
    wrong = [f"{m} ({LAYERS[_layer(m)][0]} layer) imports {t} ({LAYERS[_layer(t)][0]} layer)"
             for m, targets in _graph().items() for t in targets if t != "baton" and _layer(t) > _layer(m)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t in ts if t != "baton"} for m, ts in _graph().items()}
    # Tarjan's strongly connected components: any with more than one module is a cycle.
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The rule would be hollow if function-level imports slipped past it."""
    code = "def f():\n    from baton.engine.engine import LLMEngine\n    import baton.cli\n"
    f = tmp_path / "m.py"
    f.write_text(code)
    modules = _modules()
    assert _imports("baton.api.x", f, modules) == {"baton.engine.engine", "baton.cli"}


def test_request_layer_and_router_path_load_neither_torch_nor_the_engine():
    code = ("import sys\n"
            "import baton.api, baton.api.client, baton.api.proto, baton.config, baton.flags\n"
            "import baton.services.router.router\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'baton.engine', "
            "'baton.model', 'baton.kernels', 'baton.loader')))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
