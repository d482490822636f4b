"""Every script in benchmarks/ runs, at the smallest sizes its flags allow: it exits 0, prints its figures and
writes its JSON where --json (kernels_bench: --output) says. Smoke runs, not measurements: nothing here is
timed, and only what a run of any speed must show is asserted. The scripts that load the default model
(those that start stacks start their own local Ray, as a user runs them) are marked slow; CI runs them too."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _against_llamacpp(out: dict, text: str) -> None:
    # No llama.cpp here: Baton's side of the real Gemma 3 270M alone.
    assert "Baton's side only" in text and out["model"].endswith("gemma-3-270m-q4_k_m.gguf")
    assert [r["prompt"][:10] for r in out["prompts"]] == ["The capita"] and out["prompts"][0]["baton"]
    assert out["scored_tokens"] > 0 and 1 < out["baton_ppl"] < 1000 and "llama_cpp_ppl" not in out


def _chunked_prefill(out: dict, text: str) -> None:
    settings = [(r["chunked"], r["prefill_order"]) for r in out["results"]]
    assert settings == [(True, "arrival"), (False, "arrival"), (True, "shortest")]
    for r in out["results"]:
        assert not r["errors"] and r["short_requests"] >= 1 and len(r["long_ttft_s"]) == 1
        assert 0 < r["short_ttft_p50_s"] <= r["short_ttft_max_s"]
    assert re.search(r"short TTFT p95, off / on: [\d.]+x", text)


def _decode_throughput(out: dict, text: str) -> None:
    (row,) = out["rows"]
    assert row["batch"] == 1 and row["baton"]["tokens_per_s"] > 0 and row["ceiling_tokens_per_s"] > 0
    assert row["transformers_by_dtype"]["float32"]["tokens_per_s"] > 0 and row["ratio_by_dtype"]["float32"] > 0
    assert len(out["batch1_rounds"]) == 1 and out["memory_read_GBps"] > 0 and out["matmul_GFLOPs"] > 0
    other = out["other_weights"]
    assert other["mode"] == "int8" and other["weight_bytes"] < other["default_weight_bytes"] and other["step_ms"] > 0
    assert re.search(r"int8 weights [\d.]+ ms", text) and "tokens/s" in text


def _eval_quant(out: dict, text: str) -> None:
    assert out["tokens"] == 64
    names = [r["name"] for r in out["rows"]]
    assert names[:4] == ["baseline", "int8-kv", "int8-weights", "int8-kv+weights"]
    assert out["rows"][0]["ppl_change_pct"] == 0 and out["rows"][0]["agreement"] == 1
    assert all(_number(r["perplexity"]) and r["tokens"] == 64 for r in out["rows"])
    assert re.search(r"baseline\s+64\s+[\d.]+", text) and "wrote" in text


def _http_vs_grpc(out: dict, text: str) -> None:
    assert [(r["round"], r["api"]) for r in out["rounds"]] == [(0, "grpc"), (0, "http")]
    assert all(not r["errors"] and r["output_tokens_per_s"] > 0 and r["ttft_p50_s"] > 0 for r in out["rounds"])
    assert out["summary"]["tokens_per_s_ratio"] > 0 and len(out["per_round_ratio"]) == 1
    assert re.search(r"medians: gRPC [\d.]+ tok/s, HTTP [\d.]+ tok/s", text)


def _kernels_bench(out: dict, text: str) -> None:
    kernels = {r["kernel"] for r in out["results"]}
    assert kernels == {"decode_attention", "write_kv"}
    assert all(r["torch_s"] > 0 for r in out["results"])
    assert "decode_attention" in text and "wrote" in text


def _prefix_cache(out: dict, text: str) -> None:
    s = out["summary"]
    assert len(out["cold"]) == 1 and len(out["warm"]) == 2
    assert all(_number(s[k]) for k in ("cold_ttft_p50_s", "first_ttft_s", "warm_ttft_p50_s", "warm_over_cold_ttft_p50"))
    # The warm requests share the 64-token system prompt: whole blocks of it come from the cache.
    assert 0 < s["warm_cached_fraction"] < 1
    assert re.search(r"cached share of warm prompt tokens: [\d.]+%", text)


def _serve_latency(out: dict, text: str) -> None:
    (level,) = out["levels"]
    assert level["concurrency"] == 1 and level["throughput_ratio"] > 0
    for side in ("stack", "single_process"):
        s = level[side]["summary"]
        assert s["requests"] == 1 and s["output_tokens"] == 2 and s["ttft_p50_s"] > 0 and s["tpot_p50_s"] > 0
    assert out["handoff"]["handoffs"] >= 1 and out["handoff"]["kv_bytes"] > 0 and out["memcpy_GBps"] > 0
    assert out["identical_outputs"]["total"] == 1
    assert re.search(r"1 stack\s+[\d.]+", text) and "KV hand-off:" in text


def _soak(out: dict, text: str) -> None:
    assert out["sent"] >= 1 and out["completed"] == out["sent"] and not out["failed"] and out["hung"] == 0
    assert out["lost"] == 0 and out["rechecked"] >= 1 and out["identical"] == out["rechecked"]
    assert out["kv_blocks_in_use_at_end"] == 0 and out["kv_exports_at_end"] == 0
    assert out["object_store_objects_at_end"] == 0
    assert re.search(r'"completed": \d+', text)


def _structured_output(out: dict, text: str) -> None:
    assert [(r["clients"], r["mode"]) for r in out["rounds"]] == [(1, "json"), (1, "free")]
    assert all(not r["errors"] and r["tokens"] > 1 and r["tpot_p50_s"] > 0 for r in out["rounds"])
    assert out["rounds"][0]["tokens"] == out["rounds"][1]["tokens"]  # the free twin decodes as many tokens
    assert len(out["compile"]["llguidance"]) == 10
    assert all(v["cold_s"] > 0 and v["cached_s"] >= 0 for v in out["compile"]["llguidance"].values())
    assert out["summary"]["1"]["tpot_ratio_json_over_free"] > 0
    assert re.search(r"1 clients: TPOT json / free = [\d.]+", text) and "llguidance compile, 10 schemas" in text


def _tracing_overhead(out: dict, text: str) -> None:
    assert [r["tracing"] for r in out["rounds"]] == [False, True]
    assert all(r["tokens"] == 4 and r["tokens_per_s"] > 0 for r in out["rounds"])
    assert out["on_over_off"] > 0 and out["spans_received"] > 0
    assert re.search(r"on / off = [\d.]+; spans received \d+", text)


def _memory_startup(out: dict, text: str) -> None:
    (run,) = out["runs"]["this"]
    assert run["decode"] == 1 and run["tokens"] > 0 and run["processes"] >= 5
    assert 0 < run["pss_mib"] <= run["rss_mib"] and run["to_serving_s"] >= run["started_in_s"] > 0
    # Both workers' breakdowns, each mapping the node's one weight image.
    assert sorted(line.split(":")[0] for line in run["breakdown"]) == [
        "memory of decode-0", "memory of prefill-0", "memory of the stack on this host"]
    assert sum("shared (a weight image)" in line for line in run["breakdown"]) == 2
    assert re.search(r"this: 1 decode: serving after [\d.]+ s \(median\), PSS \d+ MiB", text)


def _long_prefill(out: dict, text: str) -> None:
    kernel = out.pop("kernel_gflops")  # empty on CPUs without the tiled kernel
    assert all(v["tiled"] > 0 and v["rows"] > 0 for v in kernel.values())
    assert sorted(out) == ["baton", "baton fixed pinning"]  # no llama.cpp binary given: Baton's two alone
    assert all(sorted(v) == ["40", "80"] and all(t > 0 for t in v.values()) for v in out.values())
    assert re.search(r"baton throughput at 80 tokens / at 40: \d+%", text)


def _lora_throughput(out: dict, text: str) -> None:
    assert sorted(r["mode"] for r in out["rounds"]) == ["base", "lora"]
    assert all(not r["errors"] and r["tokens"] == 2 * 2 and r["tokens_per_s"] > 0 for r in out["rounds"])
    assert out["summary"]["lora_over_base"] > 0
    assert re.search(r"2 clients over 2 adapters \(rank 4, q_proj,v_proj\).*lora / base = [\d.]+", text)


def _speculative(out: dict, text: str) -> None:
    rows = out["rows"]
    assert [(r["format"], r["load"]) for r in rows] == [("q4", "edit, 1 client"), ("q4", "chat, 1 client"),
                                                        ("q4", "chat, 2 clients")]
    assert all(not r["errors"] and r["off_tokens_per_s"] > 0 and r["on_tokens_per_s"] > 0 for r in rows)
    assert all(len(r["rounds"]["on"]) == 1 for r in rows)
    assert re.search(r"q4\s+edit, 1 client\s+[\d.]+\s+[\d.]+\s+[\d.]+", text)


def _quant_formats(out: dict, text: str) -> None:
    rows = out["rows"]
    assert [(r["format"], r["clients"]) for r in rows] == [("source", 1)]
    row = rows[0]
    assert not row["errors"] and row["baton_tokens_per_s"] > 0 and row["llama_tokens_per_s"] is None
    assert row["orders"] == [["baton"]] and len(row["rounds"]["baton"]) == 1  # one stack: one round by default
    assert row["file_types"]["Q4_1"] > 0 and 0.9 < row["memory_ratio"] < 1.15  # held as stored
    assert "q4_1 x120" in row["held_as"] and "LM head q8_0" in row["held_as"]
    assert re.search(r"source\s+1\s+[\d.]+\s+-", text)


# script -> (tiny arguments, whether it loads the default model (slow), check of (JSON, stdout)).
SCRIPTS = {
    "against_llamacpp.py": (["--llama-bin", "no-such-dir", "--prompts", "1", "--max-tokens", "2", "--ctx", "256"],
                            True, _against_llamacpp),
    "chunked_prefill.py": (["--long-tokens", "64", "--duration", "1.5", "--rate", "4", "--long-every", "10",
                            "--max-tokens", "2", "--prefill-chunk", "16", "--max-batched-tokens", "32"],
                           True, _chunked_prefill),
    "decode_throughput.py": (["--batches", "1", "--output-tokens", "4", "--transformers-dtypes", "float32",
                              "--rounds", "1", "--weights", "int8"], True, _decode_throughput),
    "eval_quant.py": (["--max-tokens", "64"], True, _eval_quant),
    "http_vs_grpc.py": (["--concurrency", "1", "--requests", "2", "--warmup", "0", "--rounds", "1", "--weights", "auto",
                         "--prompt-tokens", "20", "--output-tokens", "4"], True, _http_vs_grpc),
    "kernels_bench.py": (["--quick", "--repeats", "1"], False, _kernels_bench),
    "lora_throughput.py": (["--clients", "2", "--adapters", "2", "--rank", "4", "--targets", "q_proj,v_proj",
                            "--requests", "1", "--max-tokens", "2", "--rounds", "1"], True, _lora_throughput),
    "long_prefill.py": (["--lengths", "40,80", "--rounds", "1", "--llama-server", "no-such-binary"], True,
                        _long_prefill),
    "memory_startup.py": (["--rounds", "1", "--requests", "1", "--decode-counts", "1"], True, _memory_startup),
    "prefix_cache.py": (["--system-tokens", "64", "--warm", "2", "--cold", "1", "--max-tokens", "2"], True,
                        _prefix_cache),
    "serve_latency.py": (["--concurrency", "1", "--requests-per-level", "1", "--max-tokens", "2"], True,
                         _serve_latency),
    "soak.py": (["--duration", "2", "--clients", "1", "--prefill", "1", "--decode", "1", "--max-tokens", "2"], True,
                _soak),
    "quant_formats.py": (["--formats", "source", "--clients", "1", "--requests", "1", "--output-tokens", "4",
                          "--llama-bin", "no-such-dir"], True, _quant_formats),
    "speculative.py": (["--formats", "q4", "--requests", "1", "--many", "2", "--many-requests", "2",
                        "--output-tokens", "8"], True, _speculative),
    "structured_output.py": (["--levels", "1", "--requests", "1", "--rounds", "1", "--weights", "auto"], True,
                             _structured_output),
    "tracing_overhead.py": (["--concurrency", "1", "--requests", "2", "--max-tokens", "2", "--rounds", "1"], True,
                            _tracing_overhead),
}


def test_every_benchmark_has_a_smoke_run():
    """Every script; modules named _*.py are the scripts' shared helpers."""
    assert sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if slow else [],
                                               id=name.removesuffix(".py"))
                                  for name, (_, slow, _) in SCRIPTS.items()])
def test_benchmark_runs_tiny(name, tmp_path):
    args, _, check = SCRIPTS[name]
    out = tmp_path / "out.json"
    where = ["--output", str(out)] if name == "kernels_bench.py" else ["--json", str(out)]
    # From a scratch folder, naming the output (a default relative path would write into the repository); each
    # script starts its own Ray, whatever RAY_ADDRESS the tests run under.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / name), *args, *where], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env={**env, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, f"{name} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert out.is_file(), r.stdout[-2000:]
    assert f"wrote {out}" in r.stdout
    check(json.loads(out.read_text()), r.stdout)
