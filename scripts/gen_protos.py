"""Regenerates the Python gRPC stubs in baton/v1/ from protos/baton/v1/*.proto.

    .venv/bin/python scripts/gen_protos.py [OUT_DIR]

The stubs are committed; tests/test_protos.py fails when they drift from the protos.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> None:
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", *protos])
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
