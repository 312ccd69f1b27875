"""Chapter 1, the map: the whole Llama forward pass in readable NumPy, checked against transformers."""
