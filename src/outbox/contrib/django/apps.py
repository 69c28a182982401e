"""The Django app: ``INSTALLED_APPS += ["outbox.contrib.django"]``.

It brings the outbox table as a Django migration (``manage.py migrate`` and the test
runner create it, with the same DDL as ``outbox migrate`` on every backend), the
management commands ``outbox_migrate``, ``outbox_status``, ``outbox_dead``,
``outbox_purge`` and ``outbox_check`` (the ``outbox`` command under Django's settings),
and an admin page for the outbox rows.
"""

from __future__ import annotations

from django.apps import AppConfig

#: The relay's own programs (``celery -A outbox worker|beat``, Dramatiq's worker and scheduler,
#: the ``outbox`` command): they set Django up to read the settings and enqueue nothing.
RELAY_PROGRAMS = ("celery", "dramatiq", "outbox", "outbox-dramatiq-scheduler")


class OutboxConfig(AppConfig):
    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A web process without the workers' Celery broker settings cannot wake the relay:
        # say so once, at start-up, rather than let every wake-up do nothing silently.
        import os
        import sys

        from ..startup import warn_if_wake_cannot_work

        # Management commands other than runserver (migrate, outbox_status, ...) enqueue
        # nothing: no warning there. Web servers (runserver, gunicorn, uwsgi...) get it.
        program = os.path.basename(sys.argv[0]) if sys.argv else ""
        if program in ("manage.py", "django-admin", "__main__.py") and sys.argv[1:2] != ["runserver"]:
            return
        # runserver's autoreloader runs ready() in its watching parent too, which serves
        # nothing: the serving child (RUN_MAIN=true) says it, once (it came twice).
        if sys.argv[1:2] == ["runserver"] and "--noreload" not in sys.argv and os.environ.get("RUN_MAIN") != "true":
            return
        # The relay's own processes are no web process: Celery sets Django up in `celery -A outbox
        # worker|beat` when DJANGO_SETTINGS_MODULE is set, and there the warning ("wake-ups reach
        # no worker") contradicted the worker's own "this worker runs the schedule itself".
        if program in RELAY_PROGRAMS:
            return
        from ...core.config import get_settings, reset_settings, wake_options

        try:
            # What enqueue reads, read now: an invalid value stops the web process here, naming
            # the setting (docs/django.md, "Settings").
            get_settings()
            wake_options()
            warn_if_wake_cannot_work("Django")
        finally:
            # The check read the settings (Celery's app reads them through the cache): forget
            # them. Under pytest-django this runs before the test database exists, and the
            # cached database URL kept the real one for the commands and any in-process relay
            # of the tests (docs/django.md, "Tests of your project").
            reset_settings()
