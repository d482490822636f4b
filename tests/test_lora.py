"""LoRA adapters in the engine: PEFT folders made here with peft, greedy output against transformers + peft in
float32 (one at a time, in mixed batches with the base model, chunked, from the prefix cache, across a
hand-off), the slot table, the batched delta against its reference, and bad adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.api.adapters import LoraError, content_id
from baton.api.prefix import adapter_root, hash_full_blocks
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from baton.model.lora import AdapterCache, LoraBatch, LoraSlots, SlotTable, load_adapter, lora_delta_reference
from tests.conftest import make_peft_adapter, peft_reference
from tests.oracle import assert_greedy_match, hf_from_loaded, hf_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Three adapters: two ranks, different target modules; all with random non-zero B.
ADAPTERS = {
    "qv": dict(r=4, targets=["q_proj", "v_proj"], seed=1),
    "mlp": dict(r=8, targets=["gate_proj", "up_proj", "down_proj", "o_proj"], seed=2),
    "all": dict(r=2, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                seed=3, rslora=True, alpha=4),
}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 40)]


@pytest.fixture(scope="module")
def tiny_lora(tiny_llama_dir, tmp_path_factory):
    loaded = load_model(str(tiny_llama_dir))
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    folders = {name: make_peft_adapter(base, root / name, b_scale=4.0, **spec) for name, spec in ADAPTERS.items()}
    prompts = _prompts(loaded.tokenizer.vocab_size)
    vocab = loaded.tokenizer.vocab_size
    refs = {None: [hf_greedy(base, p, GREEDY.max_tokens, vocab) for p in prompts]}
    for name, folder in folders.items():
        ref_model = peft_reference(base, folder)
        refs[name] = [hf_greedy(ref_model, p, GREEDY.max_tokens, vocab) for p in prompts]
    return loaded, folders, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def _adapter(engine: LLMEngine, folders, name: str | None):
    if name is None:
        return None
    return load_adapter(name, folders[name], engine.model_config, engine.config.max_lora_rank)


def test_adapters_really_change_the_output(tiny_lora):
    _, _, prompts, refs = tiny_lora
    for name in ADAPTERS:
        assert refs[name][-1].token_ids != refs[None][-1].token_ids, name


def test_each_adapter_alone_matches_peft(tiny_lora):
    loaded, folders, prompts, refs = tiny_lora
    engine = _engine(loaded, enable_prefix_caching=False)
    for name in [None, *ADAPTERS]:
        adapter = _adapter(engine, folders, name)
        for i, p in enumerate(prompts):
            (out,) = engine.generate([p], GREEDY, [adapter])
            assert_greedy_match(out.token_ids, refs[name][i], f"{name} prompt {i}")
    engine.scheduler.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("budget", [1024, 7])
def test_mixed_batch_base_and_three_adapters(tiny_lora, budget):
    """Base + 3 adapters in the same passes (budget 7: chunked prefill beside decodes of other adapters)."""
    loaded, folders, prompts, refs = tiny_lora
    engine = _engine(loaded, max_num_batched_tokens=budget)
    names = [None, *ADAPTERS]
    jobs = [(name, i) for i in range(len(prompts)) for name in names]
    adapters = {n: _adapter(engine, folders, n) for n in names}
    outs = engine.generate([prompts[i] for _, i in jobs], GREEDY, [adapters[n] for n, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        assert_greedy_match(out.token_ids, refs[name][i], f"{name} prompt {i}")
    engine.scheduler.check_integrity()


def test_more_adapters_than_slots_wait_for_a_slot(tiny_lora):
    """One slot, three adapters at once: requests wait for the slot and every output is still right."""
    loaded, folders, prompts, refs = tiny_lora
    engine = _engine(loaded, max_loras=1)
    names = list(ADAPTERS)
    outs = engine.generate([prompts[1]] * 3, GREEDY, [_adapter(engine, folders, n) for n in names])
    for name, out in zip(names, outs):
        assert_greedy_match(out.token_ids, refs[name][1], name)
    assert engine.slot_table.evictions == 2
    assert not engine._parked and engine.num_requests == 0


def test_prefix_cache_is_keyed_by_adapter_content(tiny_lora, tmp_path):
    """One prompt under two adapters: each computes its own KV; a repeat under the same adapter hits the
    cache; the same name reloaded with other weights hits nothing and gives the new adapter's output."""
    loaded, folders, prompts, refs = tiny_lora
    engine = _engine(loaded)
    p = prompts[3]
    qv, mlp = _adapter(engine, folders, "qv"), _adapter(engine, folders, "mlp")
    (a,) = engine.generate([p], GREEDY, [qv])
    (b,) = engine.generate([p], GREEDY, [mlp])
    (c,) = engine.generate([p], GREEDY, [None])
    (d,) = engine.generate([p], GREEDY, [qv])
    assert a.cached_prompt_tokens == b.cached_prompt_tokens == c.cached_prompt_tokens == 0
    assert d.cached_prompt_tokens == (len(p) - 1) // 4 * 4 > 0
    assert_greedy_match(b.token_ids, refs["mlp"][3], "mlp after qv")
    assert_greedy_match(c.token_ids, refs[None][3], "base after adapters")
    assert_greedy_match(d.token_ids, refs["qv"][3], "qv from cache")
    # "qv" reloaded with the weights of "all": a new content id, no stale KV
    shutil.copytree(folders["all"], tmp_path / "qv")
    reloaded = load_adapter("qv", tmp_path / "qv", engine.model_config, 16)
    assert reloaded.content_id != qv.content_id
    (e,) = engine.generate([p], GREEDY, [reloaded])
    assert e.cached_prompt_tokens == 0
    assert_greedy_match(e.token_ids, refs["all"][3], "reloaded")
    # the same files under another name are the same content: their KV is shared
    (f,) = engine.generate([p], GREEDY, [load_adapter("other", folders["mlp"], engine.model_config, 16)])
    assert f.cached_prompt_tokens == d.cached_prompt_tokens


def test_hand_off_keeps_the_adapter(tiny_lora):
    """Prefill on one engine, decode on another, both under the same adapter: the reference's tokens."""
    loaded, folders, prompts, refs = tiny_lora
    pre, dec = _engine(loaded), _engine(loaded)
    for i, p in enumerate(prompts):
        a_pre, a_dec = _adapter(pre, folders, "all"), _adapter(dec, folders, "all")
        rid = pre.add_request(p, GREEDY, export_kv=True, adapter=a_pre)
        first = None
        while first is None:
            first = next((o for o in pre.step() if o.request_id == rid and o.token_ids), None)
        blocks = dec.reserve_blocks(len(p) + 1)
        dec.add_prefilled(p, first.token_ids[0], GREEDY, blocks, first.kv, adapter=a_dec)
        tokens = []  # the decode engine emits the first token again, then the rest
        while dec.has_unfinished():
            for o in dec.step():
                tokens += o.token_ids
        assert_greedy_match(tokens, refs["all"][i], f"hand-off {i}")
        pre.abort(rid)


def test_adapter_block_hashes_start_from_the_content_id():
    ids = list(range(40))
    base = hash_full_blocks(ids, 16)
    one, two = (hash_full_blocks(ids, 16, adapter_root(c)) for c in ("a" * 24, "b" * 24))
    assert len({base[0], one[0], two[0]}) == 3 and adapter_root("") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_delta_matches_the_row_by_row_reference(dtype):
    from baton.config import ModelConfig

    cfg = ModelConfig("llama", 64, 32, 48, 2, 4, 2, 8)
    slots = LoraSlots(cfg, 3, 4, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        for k in slots.a[layer]:
            slots.a[layer][k].copy_(torch.randn(slots.a[layer][k].shape, generator=g))
            slots.b[layer][k].copy_(torch.randn(slots.b[layer][k].shape, generator=g))
    for k, (_, outs) in slots.shapes.items():  # B's blocks outside each part's own columns stay zero
        w, r = slots.width[k], slots.max_rank
        for layer in range(2):
            for s in range(3):
                for p in range(len(outs)):
                    rows = slice(s * w + p * r, s * w + (p + 1) * r)
                    keep = slots.b[layer][k][rows, sum(outs[:p]):sum(outs[:p + 1])].clone()
                    slots.b[layer][k][rows] = 0
                    slots.b[layer][k][rows, sum(outs[:p]):sum(outs[:p + 1])] = keep
    for k in slots.targeting:
        slots.targeting[k] = {0, 1, 2}
    for k in slots.part_targeting:
        slots.part_targeting[k] = {0, 1, 2}
    slots.repack()
    x = torch.randn(7, 32, generator=g).to(dtype)
    for rows in ([0, 1, 2, -1, 1, 0, -1], [2] * 7, [-1, 1, -1, 1, 1, -1, -1]):
        r = torch.tensor(rows)
        y = torch.zeros(7, 32 + 2 * 16, dtype=dtype)
        slots.add(1, "qkv", x, y, LoraBatch(r, 3, dtype))
        ref = lora_delta_reference(x, slots.a[1]["qkv"], slots.b[1]["qkv"], r, slots.width["qkv"])
        tol = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        assert not y[r < 0].any()


def test_slot_table_pins_and_reuses_least_recently_used(tiny_lora):
    loaded, folders, _, _ = tiny_lora
    cfg = loaded.config
    table = SlotTable(LoraSlots(cfg, 2, 16, torch.float32, torch.device("cpu")))
    a, b, c = (load_adapter(n, folders[n], cfg, 16) for n in ADAPTERS)
    sa, sb = table.acquire(a), table.acquire(b)
    assert {sa, sb} == {0, 1} and table.acquire(c) is None  # both pinned
    table.release(sa)
    assert table.acquire(c) == sa and table.evictions == 1  # a's slot reused
    assert table.acquire(b) == sb  # held already: no load
    assert sorted(table.holding()) == sorted([b.content_id, c.content_id])


def test_adapter_cache_loads_once_and_checks_the_content(tiny_lora, tmp_path):
    loaded, folders, _, _ = tiny_lora
    cache = AdapterCache(loaded.config, 2, 16)
    ref = load_adapter("qv", folders["qv"], loaded.config, 16).ref
    assert cache.get(ref) is cache.get(ref) and cache.loads == 1
    moved = shutil.copytree(folders["qv"], tmp_path / "qv")
    (moved / "adapter_config.json").write_text((moved / "adapter_config.json").read_text() + " ")
    with pytest.raises(LoraError, match="changed on disk"):
        cache.get(type(ref)("qv", str(moved), "0" * 24))


def _broken(folders, tmp_path, name: str, edit) -> str:
    folder = shutil.copytree(folders[name], tmp_path / "broken")
    edit(folder)
    return str(folder)


def _config_edit(**changes):
    def edit(folder):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(changes)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


@pytest.mark.parametrize("edit,message", [
    (lambda f: (f / "adapter_model.safetensors").unlink(), "adapter_model.safetensors: missing"),
    (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json: missing"),
    (lambda f: (f / "adapter_config.json").write_text("{not json"), "not valid JSON"),
    (lambda f: (f / "adapter_model.safetensors").write_bytes(b"garbage"), "not a readable safetensors"),
    (_config_edit(r=32), "rank 32 is above the server's bound of 16"),
    (_config_edit(r="four"), "'r' must be a positive integer"),
    (_config_edit(target_modules=["c_attn", "q_proj"]), "target modules c_attn are not projections"),
    (_config_edit(peft_type="IA3"), "peft_type 'IA3' is not served"),
    (_config_edit(use_dora=True), "DoRA"),
    (_config_edit(r=3), "has shape"),
])
def test_bad_adapters_name_what_to_fix(tiny_lora, tmp_path, edit, message):
    loaded, folders, _, _ = tiny_lora
    folder = _broken(folders, tmp_path, "qv", edit)
    with pytest.raises(LoraError, match=message):
        load_adapter("x", folder, loaded.config, 16)
    with pytest.raises(LoraError, match="does not exist"):
        load_adapter("x", tmp_path / "nowhere", loaded.config, 16)


def test_content_id_follows_the_files(tiny_lora, tmp_path):
    _, folders, _, _ = tiny_lora
    copy = shutil.copytree(folders["qv"], tmp_path / "copy")
    assert content_id(copy) == content_id(folders["qv"]) != content_id(folders["mlp"])


# ---- the default model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_lora(tmp_path_factory):
    loaded = load_model(None)
    base = hf_from_loaded(loaded)
    root = tmp_path_factory.mktemp("smol-adapters")
    folders = {
        "qv8": make_peft_adapter(base, root / "qv8", r=8, targets=["q_proj", "v_proj"], seed=5, b_scale=0.5),
        "mlp16": make_peft_adapter(base, root / "mlp16", r=16, targets=["gate_proj", "up_proj", "down_proj"],
                                   seed=6, b_scale=0.5),
        "attn4": make_peft_adapter(base, root / "attn4", r=4, targets=["k_proj", "o_proj"], seed=7, b_scale=0.5),
    }
    tok = loaded.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about the sea.")]
    refs = {None: [hf_greedy(base, p, GREEDY.max_tokens) for p in prompts]}
    for name, folder in folders.items():
        ref_model = peft_reference(base, folder)
        refs[name] = [hf_greedy(ref_model, p, GREEDY.max_tokens) for p in prompts]
    return loaded, folders, prompts, refs


@pytest.mark.slow  # loads the default model
def test_default_model_adapters_alone_and_mixed_match_peft(smol_lora):
    loaded, folders, prompts, refs = smol_lora
    assert any(refs[n][0].token_ids != refs[None][0].token_ids for n in folders)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=64 << 20), loaded=loaded)
    adapters = {n: load_adapter(n, f, engine.model_config, 16) for n, f in folders.items()}
    adapters[None] = None
    for name, adapter in adapters.items():
        (out,) = engine.generate(prompts[:1], GREEDY, [adapter])
        assert_greedy_match(out.token_ids, refs[name][0], f"{name} alone")
    jobs = [(n, i) for i in range(len(prompts)) for n in adapters]
    outs = engine.generate([prompts[i] for _, i in jobs], GREEDY, [adapters[n] for n, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        assert_greedy_match(out.token_ids, refs[name][i], f"{name} mixed {i}")


def test_bfloat16_with_the_c_layer_ops_matches_peft(tiny_lora, tiny_llama_dir):
    """bfloat16 on CPU (the C layer ops and kernels around the LoRA deltas): the tokens of transformers + peft
    in bfloat16, near-ties judged at bfloat16 resolution."""
    loaded, folders, prompts, _ = tiny_lora
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    engine = _engine(loaded, dtype="bfloat16")
    vocab = loaded.tokenizer.vocab_size
    names = list(ADAPTERS)
    adapters = [_adapter(engine, folders, n) for n in names]
    outs = engine.generate([prompts[2]] * len(names), GREEDY, adapters)
    for name, out in zip(names, outs):
        ref = hf_greedy(peft_reference(base, folders[name]).to(torch.bfloat16), prompts[2], GREEDY.max_tokens, vocab)
        assert_greedy_match(out.token_ids, ref, f"{name} bf16", gap=0.1)


def test_whole_layer_decode_with_lora_rows_matches_the_layer_loop(tiny_lora):
    """bfloat16 on AVX512-BF16 CPUs: decode passes with adapter rows run inside the whole-layer C call (the
    slots' packed layouts in its plan); same tokens as the per-layer loop, mixed with base rows."""
    loaded, folders, prompts, _ = tiny_lora
    engine = _engine(loaded, dtype="bfloat16")
    if not engine.model.whole_layer_decode:
        pytest.skip("this CPU has no whole-layer bfloat16 decode (AVX512-BF16)")
    names = [None, *ADAPTERS, *ADAPTERS, None]
    adapters = [_adapter(engine, folders, n) for n in names]
    batch = [prompts[i % len(prompts)] for i in range(len(names))]
    calls = []
    run = engine.model._decode_layers
    engine.model._decode_layers = lambda *a: (calls.append(a[5] is not None), run(*a))[1]
    whole = [o.token_ids for o in engine.generate(batch, GREEDY, adapters)]
    assert calls.count(True) >= GREEDY.max_tokens - 2  # decode passes with LoRA rows ran in the C call
    engine.model.whole_layer_decode = False
    assert [o.token_ids for o in engine.generate(batch, GREEDY, adapters)] == whole


def test_a_held_adapter_does_not_wait_behind_parked_requests(tiny_lora):
    loaded, folders, prompts, refs = tiny_lora
    engine = _engine(loaded, max_loras=1)
    qv, mlp = _adapter(engine, folders, "qv"), _adapter(engine, folders, "mlp")
    a = engine.add_request(prompts[1], GREEDY, adapter=qv)
    b = engine.add_request(prompts[1], GREEDY, adapter=mlp)  # the one slot is qv's, pinned: b waits
    c = engine.add_request(prompts[1], GREEDY, adapter=qv)  # qv holds the slot: c runs beside a
    assert [r.seq.request_id for r in engine._parked] == [b]
    assert {s.request_id for s in engine.scheduler.waiting} == {a, c}
    assert engine.abort(b) and not engine._parked  # a parked request can be cancelled
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert_greedy_match(outs[a], refs["qv"][1], "a") and assert_greedy_match(outs[c], refs["qv"][1], "c")
    assert engine.slot_table._pins == [0]


def test_a_parked_hand_off_is_freed_when_cancelled_and_runs_once_a_slot_frees(tiny_lora):
    """A prefilled request whose adapter waits for the one slot: cancelled, its reserved blocks go back to the
    pool; otherwise it runs once the slot's request ends, with the reference's tokens."""
    loaded, folders, prompts, refs = tiny_lora
    pre, dec = _engine(loaded), _engine(loaded, max_loras=1)
    qv, mlp = _adapter(dec, folders, "qv"), _adapter(dec, folders, "mlp")
    dec.add_request(prompts[3], GREEDY, adapter=qv)  # pins the only slot
    free = dec.pool.num_free_blocks
    for cancel in (True, False):
        rid = pre.add_request(prompts[1], GREEDY, export_kv=True, adapter=_adapter(pre, folders, "mlp"))
        first = None
        while first is None:
            first = next((o for o in pre.step() if o.request_id == rid and o.token_ids), None)
        pre.abort(rid)
        blocks = dec.reserve_blocks(len(prompts[1]) + 1)
        did = dec.add_prefilled(prompts[1], first.token_ids[0], GREEDY, blocks, first.kv, adapter=mlp)
        assert [r.seq.request_id for r in dec._parked] == [did]
        if cancel:
            assert dec.abort(did)
            assert not dec._parked and dec.pool.num_free_blocks == free
    tokens = []
    while dec.has_unfinished():
        tokens += [t for o in dec.step() if o.request_id == did for t in o.token_ids]
    assert_greedy_match(tokens, refs["mlp"][1], "parked hand-off")
    assert dec.pool.num_free_blocks == dec.pool.num_blocks and dec.slot_table.evictions == 1
