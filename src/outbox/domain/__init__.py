"""The domain: events (validation, encoding) and per-aggregate chains."""
