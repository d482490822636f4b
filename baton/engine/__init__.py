"""Engine: scheduling, paged KV cache bookkeeping and the model runner."""
