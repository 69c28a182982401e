"""``manage.py outbox_status``: ``outbox status`` with Django's settings (see ``_outbox.py``)."""

from ._outbox import OutboxCommand


class Command(OutboxCommand):
    help = "outbox status, with Django's settings; --help lists its options"
    cli_args = ["status"]
