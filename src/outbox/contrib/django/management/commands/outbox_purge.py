"""``manage.py outbox_purge``: ``outbox purge`` with Django's settings (see ``_outbox.py``)."""

from ._outbox import OutboxCommand


class Command(OutboxCommand):
    help = "outbox purge, with Django's settings; --help lists its options"
    cli_args = ["purge"]
