"""Chapter 6, the paged KV cache: one pool of 16-token blocks for every sequence, read through block tables."""
