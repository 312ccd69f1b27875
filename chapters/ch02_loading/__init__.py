"""Chapter 2, loading: safetensors from scratch, bf16, one blob for all weights, the buffer plan."""
