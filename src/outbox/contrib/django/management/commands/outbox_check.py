"""``manage.py outbox_check``: ``outbox check`` with Django's settings (see ``_outbox.py``)."""

from ._outbox import OutboxCommand


class Command(OutboxCommand):
    help = "outbox check, with Django's settings; --help lists its options"
    cli_args = ["check"]
