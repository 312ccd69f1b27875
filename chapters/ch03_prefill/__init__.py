"""Chapter 3, prefill: the whole prompt through every layer at once, on CUDA kernels or their NumPy twins."""
