"""The model on one device: weights, buffers, the KV pools, the forward pass, CUDA graphs, backends and kernels.

It reads a step plan and never decides what runs. Imports formats/ only."""
