"""Records what llama.cpp's `llama-server` answers to the requests `baton bench` sends to an OpenAI-compatible
target (GET /v1/models, then a streamed POST /v1/completions with the body OpenAIClient builds), byte for byte
after HTTP's own framing, for tests/test_documented.py to replay:

    (cd FOLDER-OF-THE-GGUF && ../shared/peers/llama_server.sh start 8089 SmolLM2-135M-Instruct.Q4_1.gguf)
    python tests/data/llama_server/record.py http://127.0.0.1:8089 tests/data/llama_server
    ../shared/peers/llama_server.sh stop

Each file is the status line, the headers (without Transfer-Encoding and Content-Length, which the replay
sets again) and the body. Started from the model's folder, the server names the model by its file name.
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from urllib.parse import urlparse

# What baton.bench.runner.OpenAIClient sends, with a fixed prompt.
COMPLETION = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 24, "stream": True,
              "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}


def _record(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None, out: Path) -> None:
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = conn.getresponse()
    headers = "".join(f"{k}: {v}\r\n" for k, v in r.getheaders()
                      if k.lower() not in ("transfer-encoding", "content-length"))
    out.write_bytes(f"HTTP/1.1 {r.status} {r.reason}\r\n{headers}\r\n".encode() + r.read())
    print(f"wrote {out}")


def main() -> int:
    base, folder = urlparse(sys.argv[1]), Path(sys.argv[2])
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=120)
    _record(conn, "GET", "/v1/models", None, folder / "models.http")
    model = json.loads((folder / "models.http").read_bytes().split(b"\r\n\r\n", 1)[1])["data"][0]["id"]
    conn.close()
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=120)
    _record(conn, "POST", "/v1/completions", {"model": model, **COMPLETION}, folder / "completions.http")
    return 0


if __name__ == "__main__":
    sys.exit(main())
