"""Framework helpers: ``outbox.contrib.django`` and ``outbox.contrib.flask`` enqueue on the
framework's current transaction and wake the relay once it commits (``outbox.wake``)."""
