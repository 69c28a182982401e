"""Storage: the store over one table and the per-engine modules."""
