"""Block keys bit for bit with the engines: the algorithm names and incremental hasher
(:mod:`~kvpool.hashing.keys`), their validated inputs, TensorRT-LLM's v1 and v2 keys, vLLM's
key, and the optional numba kernels. Imports nothing of kvpool but :mod:`kvpool.errors`."""
