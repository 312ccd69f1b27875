"""Chapter 5, decode: one token at a time, from a KV cache, through the decode attention kernel."""
