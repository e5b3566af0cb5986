"""The device side of an iteration: the batch's arrays (input_batch.py), the weights and KV pages by
pipeline stage (model_runner.py, stage.py), the compiled programs (compilation.py, executable_cache.py),
the pool's size (kv_pool.py), prompt logprobs, and several controller processes (multihost.py)."""
