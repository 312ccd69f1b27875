"""The engine: the loop, the scheduler and the KV blocks it owns, sequences, sampling. Imports model/ and formats/."""
