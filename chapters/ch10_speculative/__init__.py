"""Chapter 10, speculative decoding: more than one token per step, and the same answer."""
