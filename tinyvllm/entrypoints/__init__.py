"""The faces of the engine: the Python API (LLM), the CLI, the chat loop, the OpenAI server. Imports engine/, model/, formats/."""
