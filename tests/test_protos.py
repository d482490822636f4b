"""The committed gRPC stubs are exactly what the protos generate."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_match_protos(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "baton" / "v1").iterdir())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "baton" / "v1").iterdir()
                       if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert generated == committed, "stub files differ from the protos: run scripts/gen_protos.py"
    drifted = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not drifted, f"stale stubs {drifted}: run scripts/gen_protos.py"


def test_public_api_shape():
    from baton.v1 import generation_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["Generation"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert methods == {"Generate": (False, True), "Tokenize": (False, False), "Detokenize": (False, False),
                       "ListModels": (False, False), "LoadAdapter": (False, False),
                       "UnloadAdapter": (False, False)}
    req = pb.GenerateRequest.DESCRIPTOR
    assert {f.name for f in req.oneofs_by_name["input"].fields} == {"prompt", "messages", "prompt_token_ids"}
