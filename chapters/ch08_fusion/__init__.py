"""Chapter 8, fusion: decode at the memory-bandwidth floor, fewer kernels that each do their neighbours' work."""
