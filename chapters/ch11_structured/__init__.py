"""Chapter 11, structured outputs: a regex or JSON-schema automaton turned into a token mask before sampling."""
