"""The course: one package per chapter, each using the engine in tinyvllm/ up to its layer."""
