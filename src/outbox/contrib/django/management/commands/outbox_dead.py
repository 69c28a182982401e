"""``manage.py outbox_dead``: ``outbox dead`` with Django's settings (see ``_outbox.py``)."""

from ._outbox import OutboxCommand


class Command(OutboxCommand):
    help = "outbox dead, with Django's settings; --help lists its options"
    cli_args = ["dead"]
