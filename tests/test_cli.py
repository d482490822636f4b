"""The `baton generate` command on the default model, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args], capture_output=True, text=True, timeout=300)


# The default model's file, run as stored (--weights auto: llama.cpp's arithmetic for it), answers the bare
# question with a near-tie flip ("L'Étoile, ..."); asked for one word it answers as the dequantized model does.
QUESTION = "What is the capital of France? Answer in one word."


@pytest.mark.slow  # loads the default model
def test_chat_answers_paris():
    r = _baton("generate", "--chat", "--prompt", QUESTION, "--temperature", "0",
               "--max-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"
    assert len(out["token_ids"]) <= 24


@pytest.mark.slow  # loads the default model
def test_streams_text():
    r = _baton("generate", "--chat", "--prompt", QUESTION, "--temperature", "0",
               "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, default_model_path):
    d = tmp_path_factory.mktemp("bad")
    data = Path(default_model_path).read_bytes()
    (d / "truncated.gguf").write_bytes(data[: len(data) // 3])
    (d / "garbage.gguf").write_bytes(b"not a gguf file at all" * 100)
    return d


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "word " * 9000], "tokens but the context holds"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["--prompt", "hi", "--model", "{bad}/truncated.gguf"], "truncated.gguf"),
    (["--prompt", "hi", "--model", "{bad}/garbage.gguf"], "garbage.gguf"),
])
@pytest.mark.slow  # loads the default model
def test_bad_input_is_a_clear_error(args, message, bad_files):
    args = [a.replace("{bad}", str(bad_files)) for a in args]
    r = _baton("generate", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("baton: error: ")
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize("args,message", [
    (["--redis-url", "http://localhost:6379"], "redis://"),
    (["--prefix-max-queue", "0"], "max queue"),
    (["--prefix-load-weight", "-1"], "load weight"),
    (["--prefill-chunk", "0"], "prefill_chunk"),
    (["--prefill", "0"], "at least one prefill"),
    (["--decode-max", "0"], "pool max"),
    (["--prefill-resources", "nonsense"], "key=value"),
    (["--decode-resources", '{"decode_node": "many"}'], "decode_node"),
])
def test_bad_serve_flags_are_clear_errors(args, message):
    r = _baton("serve", "--port", "0", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and message in r.stderr, r.stderr
