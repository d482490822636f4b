"""`baton bench`: its arithmetic on known timings, its workloads, and real runs against the session's
Baton stack and against a small OpenAI-compatible server started here."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.bench import workloads as wl
from baton.bench.cli import build_workload, run_bench
from baton.bench.report import SLO, RequestRecord, percentile, summarize, table
from baton.bench.runner import closed_loop, poisson_times
from baton.cli import build_parser, main

PNG = b"\x89PNG\r\n\x1a\n"


def test_percentiles_goodput_and_cost_on_known_timings():
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    recs = [
        RequestRecord("a", "chat", sent=0.0, output_tokens=3, token_times=[0.5, 0.6, 0.7], done=0.7),  # fast
        RequestRecord("b", "chat", sent=1.0, output_tokens=3, token_times=[3.0, 3.2, 3.4], done=3.4),  # slow TTFT
        RequestRecord("c", "chat", sent=2.0, output_tokens=3, token_times=[2.2, 2.5, 2.8], done=2.8),  # slow TPOT
        RequestRecord("d", "chat", sent=3.0, error="UNAVAILABLE", done=3.1),
    ]
    assert recs[0].ttft == pytest.approx(0.5) and recs[0].tpot == pytest.approx(0.1)
    assert recs[1].itl == pytest.approx([0.2, 0.2]) and recs[2].e2e == pytest.approx(0.8)
    s = summarize(recs, window_s=4.0, slo=SLO(ttft_s=1.0, tpot_s=0.2, percentile=50), price_per_hour=3.6)
    assert s["requests"] == 4 and s["completed"] == 3 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["requests_per_s"] == pytest.approx(0.75)
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(2.25)
    assert s["ttft_s_p50"] == pytest.approx(0.5) and s["ttft_s_p99"] == pytest.approx(0.5 + 1.5 * 0.98)
    assert s["tpot_s_p50"] == pytest.approx(0.2)
    assert s["goodput_requests_per_s"] == pytest.approx(0.25)  # only "a" is within both bounds
    assert s["slo_met_share"] == pytest.approx(0.25)
    assert s["slo_met_at_percentile"] is False  # a failed request means the SLO is not met
    # $3.60 an hour = $0.001 a second; 2.25 tokens/s -> 1e6 tokens cost 0.001 / 2.25 * 1e6 dollars.
    assert s["cost_per_million_output_tokens"] == pytest.approx(0.001 / 2.25 * 1e6)
    ok = summarize(recs[:1], window_s=1.0, slo=SLO(1.0, 0.2, 95), price_per_hour=None)
    assert ok["slo_met_at_percentile"] is True and ok["cost_per_million_output_tokens"] is None
    assert "goodput" in table([{"label": "x", "stats": s}])


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a, b = poisson_times(4.0, 2000, seed=1), poisson_times(4.0, 2000, seed=1)
    assert a == b and a != poisson_times(4.0, 2000, seed=2)
    assert a == sorted(a) and 2000 / a[-1] == pytest.approx(4.0, rel=0.1)


def _args(**kw) -> argparse.Namespace:
    args = build_parser().parse_args(["bench"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_closed_loop_ramp_up_starts_the_clients_one_by_one():
    """Client k sends its first request k * ramp / concurrency seconds in; each sends its next one when
    the last ends; the warm-up is left out and the window opens at the first measured send."""
    import threading
    import time

    sends: list[tuple[str, float, str]] = []
    lock = threading.Lock()

    def send(req: wl.BenchRequest, t0: float) -> RequestRecord:
        now = time.perf_counter() - t0
        with lock:
            sends.append((req.id, now, threading.current_thread().name))
        time.sleep(0.6)  # longer than the ramp's step: each client gets to send
        rec = RequestRecord(req.id, req.kind, now, prompt_tokens=req.prompt_tokens)
        rec.token_times, rec.output_tokens, rec.done = [now + 0.01], 1, time.perf_counter() - t0
        return rec

    reqs = [wl.BenchRequest(f"r{i}", "x", 1, 1) for i in range(12)]
    records, window = closed_loop(send, reqs, 4, warmup=4, ramp_s=1.6)
    first = {}
    for _rid, t, thread in sends:
        first.setdefault(thread, t)
    starts = sorted(first.values())
    assert len(starts) == 4
    # Client k starts at k * 0.4 s: never before (a sleep does not end early). Time is the point of a ramp, so
    # the spacing has an upper bound too, from client 0's own start (the baseline: on a loaded machine new
    # threads all start late, by about as much) and generous: a thread may wake up to 1 s late (seen: 0.75 s
    # with six busy loops on this 2-core machine). That still tells 0.4 s steps from ramp_s per client (0,
    # 1.6, 3.2, ...); no ramp (all at 0) fails the lower bound.
    for k, t in enumerate(starts):
        assert k * 0.4 <= t and t - starts[0] <= k * 0.4 + 1.0, starts
    assert [s[0] for s in sorted(sends, key=lambda s: s[1])][:4] == ["r0", "r1", "r2", "r3"]
    assert sorted(r.id for r in records) == sorted(f"r{i}" for i in range(4, 12))
    # The window opens at the first measured send: when r4 is taken, just before it is sent. r3 was taken
    # before, no sooner than 0.8 s in (by then clients 0 and 1 can have taken three), so on the window's
    # clock r4 went out at 0 <= t <= (its send - 0.8), and nothing measured went out before 0.
    raw = {rid: t for rid, t, _ in sends}
    r4 = next(r for r in records if r.id == "r4")
    assert min(r.sent for r in records) >= 0 and r4.sent <= raw["r4"] - 0.8 and window > 0
    with pytest.raises(ValueError, match="ramp-up"):
        closed_loop(send, reqs, 2, ramp_s=-1)


@pytest.mark.slow  # sizes prompts with the default model's tokenizer: 10-40 s here
def test_workloads_are_reproducible_and_sized(tmp_path):
    args = _args(prompt_tokens="30:60", output_tokens="8:16", seed=5)
    a, b = build_workload(args, 6), build_workload(args, 6)
    assert a == b and build_workload(_args(prompt_tokens="30:60", output_tokens="8:16", seed=6), 6) != a
    assert all(28 <= r.prompt_tokens <= 62 and 8 <= r.max_tokens <= 16 for r in a)
    shared = build_workload(_args(workload="shared-prefix", system_tokens=200, prompt_tokens="10:20"), 3)
    prefix = shared[0].prompt[:200]
    assert all(r.prompt.startswith(prefix) and r.prompt_tokens >= 205 for r in shared)
    long = build_workload(_args(workload="long-prompt", long_tokens=500, long_every=4, prompt_tokens="20"), 8)
    assert [r.kind for r in long].count("long") == 2 and max(r.prompt_tokens for r in long) >= 495
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"prompt": "second"}\n')
    rows = build_workload(_args(workload=f"file:{f}", output_tokens="7"), 3)
    assert [(r.prompt, r.max_tokens) for r in rows] == [("hello there", 3), ("second", 7), ("hello there", 3)]
    f.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        build_workload(_args(workload=f"file:{f}"), 1)
    with pytest.raises(ValueError):
        wl.parse_range("9:3")


@pytest.mark.slow
def test_bench_against_the_baton_stack(stack, tmp_path, capsys):
    out = tmp_path / "baton.json"
    res = run_bench(_args(target=f"grpc://{stack.address}", prompt_tokens="20:40", output_tokens="8",
                          concurrency="1,3", requests=4, warmup=1, json=str(out), price_per_hour=2.0))
    assert [lv["label"] for lv in res["levels"]] == ["1 client", "3 clients"]
    for lv in res["levels"]:
        s = lv["stats"]
        assert s["completed"] == 4 and not s["errors"]
        assert s["output_tokens"] == 32 and all(r["output_tokens"] == 8 for r in lv["requests"])
        assert all(18 <= r["prompt_tokens"] <= 45 for r in lv["requests"])  # the server's count
        assert 0 < s["ttft_s_p50"] <= s["ttft_s_p99"] and s["tpot_s_p50"] > 0
        assert s["cost_per_million_output_tokens"] > 0
        assert len(lv["requests"][0]["itl_s"]) == 7
    assert json.loads(out.read_text())["levels"][1]["value"] == 3
    for name in ("baton-latency.png", "baton-goodput.png", "baton-scatter.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert "TTFT p50" in capsys.readouterr().out

    res2 = run_bench(_args(target=f"grpc://{stack.address}", prompt_tokens="20", output_tokens="4", rate="4",
                           requests=4, warmup=0, json=str(tmp_path / "open.json")))
    assert res2["levels"][0]["mode"] == "rate" and res2["levels"][0]["stats"]["completed"] == 4

    assert main(["bench", "compare", str(out), str(tmp_path / "open.json"), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare-latency.png").read_bytes()[:8] == PNG


@pytest.fixture(scope="module")
def openai_server(tiny_llama_dir):
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from tests.openai_server import OpenAIServer

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                    kv_cache_memory=16 << 20, block_size=4))
    server = OpenAIServer(engine, model="tiny-llama").start()
    yield server
    server.stop()


def test_bench_against_an_openai_compatible_server(openai_server, tmp_path):
    res = run_bench(_args(target=openai_server.url, prompt_tokens="10:20", output_tokens="6", concurrency="2",
                          requests=4, warmup=1, json=str(tmp_path / "oai.json")))
    assert res["model"] == "tiny-llama"
    s = res["levels"][0]["stats"]
    assert s["completed"] == 4 and not s["errors"] and s["output_tokens"] == 24
    assert all(r["prompt_tokens"] > 0 and r["ttft_s"] > 0 for r in res["levels"][0]["requests"])


def test_bench_flags_are_checked(capsys):
    assert main(["bench", "--target", "ftp://x:1"]) == 2
    assert "grpc://HOST:PORT" in capsys.readouterr().err
    assert main(["bench", "--concurrency", "0"]) == 2
    assert main(["bench", "--concurrency", "2", "--ramp-up", "-1"]) == 2
    assert "--ramp-up" in capsys.readouterr().err
    assert main(["bench", "compare", "/nonexistent.json"]) == 2
