"""What the ``outbox`` commands run beyond the store: the demo and the checks."""
