"""Regenerates the Python gRPC stubs in baton/v1/ from protos/baton/v1/*.proto.

    .venv/bin/python scripts/gen_protos.py [OUT_DIR]

The stubs are committed; tests/test_protos.py fails when they drift from the protos.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
GRPCIO_FLOOR = "1.66.0"  # pyproject.toml: grpcio>=1.66


def generate(out: Path) -> None:
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", *protos])
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")
    # The gRPC stubs refuse a grpcio older than the grpcio-tools that wrote them. They are stated against the
    # floor pyproject.toml requires instead, so a new grpcio-tools release neither changes the committed
    # stubs nor raises what users need.
    for stub in (out / "baton" / "v1").glob("*_pb2_grpc.py"):
        text = stub.read_text()
        pinned = re.sub(r"^GRPC_GENERATED_VERSION = '[^']*'$", f"GRPC_GENERATED_VERSION = '{GRPCIO_FLOOR}'", text,
                        count=1, flags=re.MULTILINE)
        if pinned == text and f"GRPC_GENERATED_VERSION = '{GRPCIO_FLOOR}'" not in text:
            raise SystemExit(f"{stub}: no GRPC_GENERATED_VERSION line to pin")
        stub.write_text(pinned)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
