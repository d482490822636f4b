"""The engine settings of the session's shared stack (the `stack` fixture in conftest.py)."""

from baton.config import EngineConfig

# weights="dtype": the file's weights dequantized, as the in-process reference engines the service tests compare
# the stack's answers with (built from the loaded float weights); the block types as stored are tested on their own
# (tests/test_gguf_blocks.py, tests/test_int4_checkpoints.py) and served by `baton serve`'s default
# (tests/test_serve_cli.py, tests/test_benchmarks.py's quant_formats run).
STACK_ENGINE = EngineConfig(dtype="float32", weights="dtype", kv_cache_memory=256 << 20, max_num_seqs=64)
