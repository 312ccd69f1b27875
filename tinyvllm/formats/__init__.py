"""Files on disk: the config, the tokenizer, the safetensors format, GGUF conversion, the checkpoints (default model, synthetic). Imports nothing of tinyvllm but errors."""
