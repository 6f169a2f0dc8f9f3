"""On-disk formats: pure I/O and validation, no model code."""
