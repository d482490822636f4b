"""The engine settings of the session's shared stack (the `stack` fixture in conftest.py)."""

from baton.config import EngineConfig

STACK_ENGINE = EngineConfig(dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=64)
