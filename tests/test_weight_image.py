"""Weight images (baton/model/image.py): the prepared weights written once and mapped back bit for bit, by every
engine of a folder, one build however many start at once; and the memory a worker reports (baton/memory.py):
weights shared or not, a KV pool resident only as it is used."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import threading

import pytest
import torch

from baton.api import SamplingParams
from baton.config import ConfigError, EngineConfig
from baton.engine import weights as weights_module
from baton.engine.engine import LLMEngine
from baton.kernels import cpu as cpu_kernels
from baton.loader import load_model
from baton.memory import MemoryReport, zeroed
from baton.model.image import _HEADER, MAGIC, image_key, map_image, shared_weights, write_image
from baton.model.linear import Linear
from baton.model.llama import ModelWeights

MODES = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")]
if cpu_kernels.available():
    MODES.append(("float32", "q4"))


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def _prepare(loaded, dtype: str, mode: str) -> ModelWeights:
    return ModelWeights.prepare(loaded.config, loaded.weights, getattr(torch, dtype), torch.device("cpu"), mode)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _linears(w: ModelWeights) -> list[Linear]:
    return [w.lm_head, *w.layer_linears()]


@pytest.mark.parametrize(("dtype", "mode"), MODES)
def test_an_image_maps_back_every_tensor_bit_for_bit(tmp_path, loaded, dtype, mode):
    prepared = _prepare(loaded, dtype, mode)
    path = str(tmp_path / "w.img")
    write_image(path, prepared, {"config": {"name": "tiny"}, "ids": [1, 2.5, None, True]})
    mapped, model = map_image(path)
    assert model == {"config": {"name": "tiny"}, "ids": [1, 2.5, None, True]}
    mine, theirs = prepared.tensors(), mapped.tensors()
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(_bits(a), _bits(b))
    for a, b in zip(_linears(prepared), _linears(mapped), strict=True):
        assert {k: v for k, v in vars(a).items() if not isinstance(v, (torch.Tensor, tuple))} == \
               {k: v for k, v in vars(b).items() if not isinstance(v, (torch.Tensor, tuple))}
    # Every mapped tensor is a view of the file, none a copy: the report calls them shared.
    report = MemoryReport.measure(theirs, [])
    assert report.weights == prepared.nbytes and report.weights_shared == report.weights
    assert MemoryReport.measure(mine, []).weights_shared == 0
    assert os.stat(path).st_mode & 0o077 == 0


def _config(tiny_llama_dir, folder, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20,
                        block_size=4, max_num_batched_tokens=32, shared_weights_dir=folder, **kw)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + 4 * i)] for i in range(6)]
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                                         ignore_eos=True))]


def test_engines_of_one_folder_build_once_map_the_rest_and_answer_alike(tmp_path, tiny_llama_dir, monkeypatch):
    folder = str(tmp_path / "weights")
    first = LLMEngine(_config(tiny_llama_dir, folder))
    with monkeypatch.context() as m:  # the second one never opens the model files: all it needs is in the image
        m.setattr(weights_module, "load_model", _no_model_files)
        second = LLMEngine(_config(tiny_llama_dir, folder))
    own = LLMEngine(_config(tiny_llama_dir, None))
    assert first.weights_source == "built a shared image"
    assert second.weights_source == "mapped from a shared image"
    assert own.weights_source == "own copy"
    assert _greedy(first) == _greedy(second) == _greedy(own)
    # The second read the model's config and tokenizer from the image, not from the model files.
    assert second.model_config == own.model_config
    tok, ref = second.tokenizer, own.tokenizer
    assert tok.state() == ref.state() and tok.encode("Hello world, hello") == ref.encode("Hello world, hello")
    assert [n for n in os.listdir(folder) if n.endswith(".img")] != []
    # No engine keeps the file's weights once its model holds them.
    assert first.loaded.weights == {} and own.loaded.weights == {}
    shared, private = second.memory(), own.memory()
    assert shared.weights_shared == shared.weights > 0
    assert private.weights_shared == 0 and private.weights == shared.weights


def _no_model_files(*args, **kwargs):
    raise AssertionError("the model files were read")


def test_many_engines_starting_at_once_build_one_image(tmp_path, loaded):
    builds = []

    def build() -> tuple[ModelWeights, None]:
        builds.append(threading.get_ident())
        return _prepare(loaded, "float32", "auto"), None

    results: list = [None] * 4

    def start(i: int) -> None:
        results[i] = shared_weights(str(tmp_path / "w"), "k", build)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert sorted(built for _, _, built in results) == [False, False, False, True]
    reference = results[0][0].tensors()
    for weights, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(reference, weights.tensors(), strict=True))


def test_an_image_cut_short_is_built_again(tmp_path, loaded):
    folder = tmp_path / "w"
    shared_weights(str(folder), "k", lambda: (_prepare(loaded, "float32", "auto"), None))
    image = next(folder.glob("*.img"))
    size = image.stat().st_size
    with open(image, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="the header says"):
        map_image(str(image))
    weights, _, built = shared_weights(str(folder), "k", lambda: (_prepare(loaded, "float32", "auto"), None))
    assert built and image.stat().st_size == size and weights.nbytes > 0


def test_the_image_name_follows_the_file_and_the_preparation(tmp_path, tiny_llama_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    key = image_key(str(model), torch.float32, "auto", (True, False, False))
    assert key == image_key(str(model), torch.float32, "auto", (True, False, False))
    assert key != image_key(str(model), torch.bfloat16, "auto", (True, False, False))
    assert key != image_key(str(model), torch.float32, "int8", (True, False, False))
    assert key != image_key(str(model), torch.float32, "auto", (True, True, False))
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert key != image_key(str(model), torch.float32, "auto", (True, False, False))


def test_an_image_builds_nothing_but_the_weights_classes(tmp_path):
    """A pickle naming any other callable is refused before anything runs."""
    marker = tmp_path / "ran"
    blob = io.BytesIO()
    pickle.dump(_Payload(str(marker)), blob, protocol=5)
    raw = blob.getvalue()
    path = tmp_path / "evil.img"
    data_offset = -(-(_HEADER.size + len(raw)) // 4096) * 4096
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, 1, 0, len(raw), data_offset, 0))
        f.write(raw)
        f.truncate(data_offset)
    with pytest.raises(pickle.UnpicklingError, match="may not refer to"):
        map_image(str(path))
    assert not marker.exists()


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_the_folder_must_be_the_users_own_and_closed_to_others(tmp_path, loaded):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by no one else"):
        shared_weights(str(folder), "k", lambda: (_prepare(loaded, "float32", "auto"), None))
    assert list(folder.iterdir()) == []
    made = tmp_path / "new" / "weights"
    shared_weights(str(made), "k", lambda: (_prepare(loaded, "float32", "auto"), None))
    assert made.stat().st_mode & 0o777 == 0o700


def test_the_kv_pool_is_resident_only_as_blocks_are_written(tiny_llama_dir):
    engine = LLMEngine(dataclasses.replace(_config(tiny_llama_dir, None), kv_cache_memory=256 << 20))
    idle = engine.memory()
    assert idle.kv_pool >= 250 << 20
    assert idle.kv_resident < idle.kv_pool // 100
    _greedy(engine)
    used = engine.memory()
    assert idle.kv_resident < used.kv_resident < used.kv_pool // 10
    assert not engine.kv_cache.layers[0].k[-1].any()  # a block never written reads as zeros


def test_zeroed_memory_is_zero_and_resident_only_where_written():
    from baton.memory import resident_bytes

    buf = zeroed(64 << 20)
    before = resident_bytes([buf])
    buf[: 8 << 20] = 1
    after = resident_bytes([buf])
    assert buf.numel() == 64 << 20 and before < (1 << 20) and (8 << 20) <= after < (16 << 20)
    assert int(buf[: 8 << 20].sum()) == 8 << 20 and not buf[8 << 20:].any()
