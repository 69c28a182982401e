"""``manage.py outbox_migrate``: ``outbox migrate`` with Django's settings (see ``_outbox.py``)."""

from ._outbox import OutboxCommand


class Command(OutboxCommand):
    help = "outbox migrate, with Django's settings; --help lists its options"
    cli_args = ["migrate"]
