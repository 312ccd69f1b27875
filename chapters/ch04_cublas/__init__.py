"""Chapter 4, cuBLAS: row-major math on a column-major library — the transposition trick."""
