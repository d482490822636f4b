"""A small OpenAI-compatible server for tests: /v1/models and streamed /v1/completions, backed by a real
LLMEngine on its own thread. Only what `baton bench` sends is implemented. ``usage=False`` leaves out the
final usage chunk (as servers that ignore ``stream_options.include_usage`` do). ``authorizations`` keeps the
Authorization header of every request (None when absent); nothing is checked against it."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from baton.api import InvalidRequestError, SamplingParams
from baton.config import ServeConfig, default_of
from baton.engine.engine import LLMEngine, RequestOutput
from baton.services.worker import EngineLoop


class OpenAIServer:
    def __init__(self, engine: LLMEngine, model: str = "tiny", usage: bool = True) -> None:
        self.loop = EngineLoop(engine, admission_wait=default_of(ServeConfig, "admission_wait"))
        self.model = model
        self.usage = usage
        self.chunks = 0  # text chunks streamed, over all requests
        self.authorizations: list[str | None] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, status: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                outer.authorizations.append(self.headers.get("Authorization"))
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": outer.model, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                outer.authorizations.append(self.headers.get("Authorization"))
                if self.path != "/v1/completions":
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                outer.complete(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def complete(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        engine = self.loop.engine
        try:
            params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)),
                                    temperature=float(body.get("temperature", 1.0)),
                                    ignore_eos=bool(body.get("ignore_eos", False)))
            ids = engine.tokenizer.encode(body["prompt"])
            rid = f"cmpl-{uuid.uuid4().hex[:12]}"
            q = self.loop.add(rid, lambda: engine.add_request(ids, params, request_id=rid),
                              check=lambda: engine.check_prompt(ids))
        except (InvalidRequestError, KeyError, ValueError) as e:
            h._json(400, {"error": {"message": str(e)}})
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        tokens = 0
        while True:
            out = q.get(timeout=60)
            if not isinstance(out, RequestOutput):
                break
            tokens += len(out.token_ids)
            if out.token_ids:
                chunk = {"id": rid, "object": "text_completion", "model": self.model,
                         "choices": [{"index": 0, "text": out.text or " ", "finish_reason": out.finish_reason}]}
                h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                h.wfile.flush()
                with self._lock:
                    self.chunks += 1
            if out.finished:
                break
        if self.usage:
            usage = {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens}
            h.wfile.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode())
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()
        h.close_connection = True

    def start(self) -> OpenAIServer:
        self.loop.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.stop()
