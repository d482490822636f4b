"""LoRA adapters through the whole stack (router, a prefill and a decode worker on a local Ray, Redis, the HTTP
API): adapters made here with peft on the default model, served with --lora and loaded at run time; greedy
output against transformers + peft in float32 across the hand-off, alone and mixed with the base model in one
batch; the prefix cache keyed by adapter content; load, unload and reload under load; bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from baton.api import SamplingParams
from baton.api.client import Client, generate_request
from baton.config import EngineConfig, ServeConfig
from baton.loader import load_model
from baton.serve import Stack
from baton.v1 import generation_pb2 as pb
from tests.conftest import make_peft_adapter, peft_reference
from tests.oracle import assert_greedy_match, hf_from_loaded, hf_greedy

pytestmark = pytest.mark.slow  # starts a stack and loads the default model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a terse assistant for a shipping company. Answer in one sentence and never guess."
QUESTIONS = ["Where is my parcel?", "Can I change the address?", "What does express cost?"]
SPECS = {
    "qv8": dict(r=8, targets=["q_proj", "v_proj"], seed=5),
    "mlp16": dict(r=16, targets=["gate_proj", "up_proj", "down_proj"], seed=6),
    "attn4": dict(r=4, targets=["k_proj", "o_proj"], seed=7),
}


@pytest.fixture(scope="module")
def lora_env(tmp_path_factory):
    loaded = load_model(None)
    base = hf_from_loaded(loaded)
    root = tmp_path_factory.mktemp("lora-root")
    folders = {n: make_peft_adapter(base, root / n, b_scale=0.5, **s) for n, s in SPECS.items()}
    tok = loaded.tokenizer
    prompts = [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    refs = {None: [hf_greedy(base, p, GREEDY.max_tokens) for p in prompts]}
    for name, folder in folders.items():
        model = peft_reference(base, folder)
        refs[name] = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    assert all(refs[n][0].token_ids != refs[None][0].token_ids for n in folders)  # the adapters matter
    # weights="dtype": the base model dequantized, as the transformers references compute it
    cfg = ServeConfig(engine=EngineConfig(dtype="float32", weights="dtype", kv_cache_memory=256 << 20, max_loras=3),
                      port=0,
                      metrics_port=0, http_port=0, lora=(f"qv8={folders['qv8']}", f"mlp16={folders['mlp16']}"),
                      lora_root=str(root))
    stack = Stack(cfg).start()
    yield stack, folders, prompts, refs, root
    stack.stop()


def _generate(client: Client, prompt: list[int], adapter: str = "") -> tuple[list[int], int]:
    out = client.complete(generate_request(prompt_token_ids=prompt, sampling=GREEDY, adapter=adapter), timeout=300)
    return out.token_ids, out.usage.cached_prompt_tokens


def test_adapters_are_listed_with_their_base(lora_env):
    stack, *_ = lora_env
    with Client(stack.address) as c:
        models = {m.id: m for m in c.stub.ListModels(pb.ListModelsRequest()).models}
    base = next(m for m in models.values() if not m.base)
    assert models["qv8"].base == models["mlp16"].base == base.id and models["mlp16"].lora_rank == 16
    oai = openai.OpenAI(base_url=f"http://{stack.gateway.address}/v1", api_key="x", max_retries=0)
    listed = {m.id: m for m in oai.models.list().data}
    assert listed["qv8"].model_extra["parent"] == base.id and "parent" not in listed[base.id].model_extra


def test_each_adapter_across_the_hand_off_matches_peft(lora_env):
    stack, _, prompts, refs, _ = lora_env
    with Client(stack.address) as c:
        for name in (None, "qv8", "mlp16"):
            tokens, _ = _generate(c, prompts[0], name or "")
            assert_greedy_match(tokens, refs[name][0], f"{name}")


def test_base_and_three_adapters_in_one_batch(lora_env):
    """Concurrent requests under the base model and three adapters, one of them loaded at run time: the decode
    worker's passes mix all four."""
    stack, folders, prompts, refs, _ = lora_env
    with Client(stack.address) as c:
        c.load_adapter("attn4-mixed", str(folders["attn4"]), timeout=60)
        refs = {**refs, "attn4-mixed": refs["attn4"]}
        jobs = [(name, i) for i in range(len(prompts)) for name in (None, "qv8", "mlp16", "attn4-mixed")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda j: _generate(c, prompts[j[1]], j[0] or ""), jobs))
        assert c.unload_adapter("attn4-mixed")
    for (name, i), (tokens, _) in zip(jobs, outs):
        assert_greedy_match(tokens, refs[name][i], f"{name} prompt {i}")


def test_openai_client_names_the_adapter_as_its_model(lora_env):
    stack, _, prompts, refs, _ = lora_env
    oai = openai.OpenAI(base_url=f"http://{stack.gateway.address}/v1", api_key="x", max_retries=0, timeout=300)
    out = oai.completions.create(model="mlp16", prompt=prompts[1], max_tokens=GREEDY.max_tokens, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.model == "mlp16"
    with Client(stack.address) as c:
        tokens, _ = _generate(c, prompts[1], "mlp16")
    assert_greedy_match(tokens, refs["mlp16"][1], "mlp16 over gRPC")
    assert out.choices[0].text == load_model(None, weights=False).tokenizer.decode(tokens)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)


def test_prefix_cache_is_per_adapter(lora_env):
    """One system prompt under two adapters and the base: each computes its own KV; repeats hit their own."""
    stack, _, prompts, refs, _ = lora_env
    p = prompts[2][::-1]  # no other test sends these tokens
    with Client(stack.address) as c:
        first = {n: _generate(c, p, n) for n in ("qv8", "mlp16", "")}
        again = {n: _generate(c, p, n) for n in ("qv8", "mlp16", "")}
    assert all(cached == 0 for _, cached in first.values()), first
    assert all(cached > 0 for _, cached in again.values()), again
    assert {n: t for n, (t, _) in first.items()} == {n: t for n, (t, _) in again.items()}


def test_unknown_adapter_is_not_found(lora_env):
    stack, _, prompts, _, _ = lora_env
    with Client(stack.address) as c, pytest.raises(grpc.RpcError) as e:
        _generate(c, prompts[0], "missing")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "ListModels" in e.value.details()


def test_load_unload_reload_under_load(lora_env, tmp_path):
    """Requests under qv8 and attn4 run without pause while attn4 is loaded, unloaded and reloaded with other
    weights: only requests naming attn4 while it is unloaded fail (NOT_FOUND); after the reload its answers
    are the new weights' (no stale KV), and the base never stops answering."""
    stack, folders, prompts, refs, root = lora_env
    oai = openai.OpenAI(base_url=f"http://{stack.gateway.address}/v1", api_key="x", max_retries=0, timeout=300)
    stop = threading.Event()
    failures: list[str] = []
    counts = {"qv8": 0, "": 0}

    def keep_asking(name: str) -> None:
        with Client(stack.address) as c:
            while not stop.is_set():
                try:
                    tokens, _ = _generate(c, prompts[0], name)
                    assert_greedy_match(tokens, refs[name or None][0], name)
                    counts[name] += 1
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    failures.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=keep_asking, args=(n,)) for n in ("qv8", "")]
    for t in threads:
        t.start()
    try:
        oai.post("/load_lora_adapter", body={"lora_name": "attn4", "lora_path": str(folders["attn4"])},
                 cast_to=object)
        with Client(stack.address) as c:
            tokens, _ = _generate(c, prompts[0], "attn4")
            assert_greedy_match(tokens, refs["attn4"][0], "attn4 loaded at run time")
            oai.post("/unload_lora_adapter", body={"lora_name": "attn4"}, cast_to=object)
            with pytest.raises(grpc.RpcError) as e:
                _generate(c, prompts[0], "attn4")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            # the name comes back with the weights of mlp16: its answers, none of attn4's KV
            shutil.copytree(folders["mlp16"], root / "attn4-v2")
            oai.post("/load_lora_adapter", body={"lora_name": "attn4", "lora_path": str(root / "attn4-v2")},
                     cast_to=object)
            tokens, _ = _generate(c, prompts[0], "attn4")
            assert_greedy_match(tokens, refs["mlp16"][0], "attn4 reloaded with other weights")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not failures, failures[:3]
    assert counts["qv8"] > 0 and counts[""] > 0


@pytest.mark.parametrize("edit,code,message", [
    ("missing-folder", grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
    ("bad-config", grpc.StatusCode.INVALID_ARGUMENT, "not valid JSON"),
    ("rank", grpc.StatusCode.INVALID_ARGUMENT, "above the server's bound"),
    ("targets", grpc.StatusCode.INVALID_ARGUMENT, "lm_head are not projections"),
    ("outside-root", grpc.StatusCode.FAILED_PRECONDITION, "must lie under"),
    ("bad-name", grpc.StatusCode.INVALID_ARGUMENT, "adapter names are"),
])
def test_bad_loads_name_what_to_fix_and_the_stack_serves_on(lora_env, tmp_path, edit, code, message):
    stack, folders, prompts, refs, root = lora_env
    import json

    folder = root / f"bad-{edit}"
    name = "bad"
    if edit != "missing-folder":
        shutil.copytree(folders["qv8"], folder, dirs_exist_ok=True)
    cfg_file = folder / "adapter_config.json"
    if edit == "bad-config":
        cfg_file.write_text("{")
    elif edit in ("rank", "targets"):
        cfg = json.loads(cfg_file.read_text())
        cfg.update({"r": 64} if edit == "rank" else {"target_modules": ["q_proj", "lm_head"]})
        cfg_file.write_text(json.dumps(cfg))
    elif edit == "outside-root":
        folder = shutil.copytree(folders["qv8"], tmp_path / "elsewhere")
    elif edit == "bad-name":
        name = "../etc"
    with Client(stack.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.load_adapter(name, str(folder), timeout=60)
        assert e.value.code() == code and message in e.value.details(), e.value.details()
        assert "bad" not in {m.id for m in c.stub.ListModels(pb.ListModelsRequest()).models}
        tokens, _ = _generate(c, prompts[0], "qv8")
    assert_greedy_match(tokens, refs["qv8"][0], "after a refused load")


def test_unload_of_an_unknown_adapter_is_not_found(lora_env):
    stack, *_ = lora_env
    with Client(stack.address) as c, pytest.raises(grpc.RpcError) as e:
        c.unload_adapter("never-loaded")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_count_requests_per_adapter_and_loads(lora_env):
    stack, _, prompts, _, _ = lora_env
    with Client(stack.address) as c:
        _generate(c, prompts[1], "qv8")
    router = urllib.request.urlopen(f"http://{stack.metrics_addresses['router']}/metrics", timeout=10).read().decode()
    line = next(ln for ln in router.splitlines()
                if ln.startswith("baton_lora_requests_total") and 'adapter="qv8"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 1
    assert any(ln.startswith("baton_lora_generation_tokens_total") for ln in router.splitlines())
    worker = next(a for n, a in stack.metrics_addresses.items() if n.startswith("decode"))
    text = urllib.request.urlopen(f"http://{worker}/metrics", timeout=10).read().decode()
    loads = next(ln for ln in text.splitlines() if ln.startswith("baton_lora_loads_total"))
    assert float(loads.rsplit(" ", 1)[1]) >= 1


def test_serve_refuses_a_bad_lora_flag_before_starting(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"], "peft_type": "IA3"}')
    out = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--lora", f"x={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--lora x" in out.stderr and "IA3" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--lora", "nameonly"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "NAME=PATH" in out.stderr, out.stderr
