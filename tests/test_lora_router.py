"""The router's LoRA adapters (services/router/adapters.py) and adapter-aware routing, without a stack: names,
the --lora-root rule, resolution, who holds what, and the routing preference. Adapter folders of random weights
are written here in the PEFT format; the router reads them without torch."""

from __future__ import annotations

import pytest

from baton.api.adapters import LoraError, read_adapter
from baton.config import ModelConfig
from baton.model.lora import write_random_adapter
from baton.services.router.adapters import AdapterNotFound, AdapterRefused, AdapterTable
from baton.services.router.membership import Worker
from baton.services.router.prefix import ADAPTER_MISS_TOKENS, PrefixRouter

CONFIG = ModelConfig("llama", 64, 32, 48, 2, 4, 2, 8)


def _adapter(folder, rank=4, targets=("q_proj", "v_proj"), seed=0):
    return write_random_adapter(folder, CONFIG, rank, list(targets), seed)


def test_read_adapter_without_torch_tensors(tmp_path):
    spec = read_adapter("a", _adapter(tmp_path / "a"), CONFIG, 16)
    assert spec.rank == 4 and spec.scale == 2.0 and spec.targets == {"q_proj", "v_proj"}
    assert len(spec.tensors) == 2 * 2 * CONFIG.num_layers and len(spec.ref.content_id) == 24


def test_table_names_roots_and_resolution(tmp_path):
    root = tmp_path / "root"
    a = _adapter(root / "a")
    table = AdapterTable(CONFIG, "base-model", 16, str(root))
    listed = table.add("sales-v1", str(a))
    assert table.resolve("sales-v1") == listed.ref and table.resolve("") is None and table.resolve("base-model") is None
    with pytest.raises(AdapterNotFound, match="not loaded"):
        table.resolve("other")
    for bad in ("", "../x", "a" * 65, "base-model", " x"):
        with pytest.raises(LoraError):
            table.add(bad, str(a))
    outside = _adapter(tmp_path / "outside")
    with pytest.raises(AdapterRefused, match="must lie under"):
        table.add("x", str(outside))
    with pytest.raises(AdapterRefused, match="must lie under"):  # a link out of the root is followed
        (root / "link").symlink_to(outside)
        table.add("x", str(root / "link"))
    assert AdapterTable(CONFIG, "m", 16).add("y", str(outside), at_start=True).ref.name == "y"
    with pytest.raises(AdapterRefused, match="--lora-root"):
        AdapterTable(CONFIG, "m", 16).add("y", str(outside))
    # a reload under the same name is other content
    b = _adapter(root / "b", seed=1)
    old = table.resolve("sales-v1")
    table.add("sales-v1", str(b))
    assert table.resolve("sales-v1").content_id != old.content_id
    assert table.remove("sales-v1") and not table.remove("sales-v1")


def test_holders_are_preferred_among_equals(tmp_path):
    table = AdapterTable(CONFIG, "m", 16, max_loras=2)
    ref = table.add("a", str(_adapter(tmp_path / "a")), at_start=True).ref
    ws = [Worker(f"d{i}", "decode", "", None, None) for i in range(3)]
    assert table.prefers(ws, ref, lambda w: w.in_flight) == ws  # nobody holds it: order kept
    table.sent("d2", ref)
    assert [w.name for w in table.prefers(ws, ref, lambda w: w.in_flight)] == ["d2", "d0", "d1"]
    ws[2].in_flight = 1  # a holder that is busier loses to idle workers
    assert table.prefers(ws, ref, lambda w: w.in_flight)[0].name == "d0"
    other = table.add("b", str(_adapter(tmp_path / "b", seed=2)), at_start=True).ref
    third = table.add("c", str(_adapter(tmp_path / "c", seed=3)), at_start=True).ref
    table.sent("d2", other)
    table.sent("d2", third)  # d2 keeps its max_loras (2) most recent: a dropped
    assert not table.holds("d2", ref) and table.holds("d2", third)
    table.reported("p0", [ref.content_id])
    assert table.holds("p0", ref) and not table.holds("p0", other)


def test_prefix_routing_charges_a_missing_adapter():
    router = PrefixRouter(None, 16, "m")
    ws = [Worker(f"p{i}", "prefill", "", None, None) for i in range(2)]
    holds = {"p1"}.__contains__
    assert [w.name for w in router.order(ws, 100, {}, holds)] == ["p1", "p0"]
    # a longer cached prefix outweighs the adapter miss
    assert router.order(ws, 100, {"p0": ADAPTER_MISS_TOKENS + 16}, holds)[0].name == "p0"
