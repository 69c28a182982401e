"""A web process that cannot wake the relay says so once at start-up (Django app, Flask
extension), in a fresh process each, as a web server would start them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services import ROOT

FLASK_APP = """
import logging
logging.basicConfig(level=logging.INFO)
from flask import Flask
from outbox.contrib.flask import Outbox
app = Flask("shop")
Outbox(app, session=lambda: None)
Outbox(Flask("second"), session=lambda: None)  # a second app in the same process: no second warning
print("started")
"""

DJANGO_APP = """
import logging
logging.basicConfig(level=logging.INFO)
import django
django.setup()
print("started")
"""


def start(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**clean, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples" / "django"),
                                                                                  os.environ.get("PYTHONPATH")])), **env})
    assert result.returncode == 0 and "started" in result.stdout, result.stdout + result.stderr
    return result


def test_flask_warns_once_when_the_broker_is_in_memory(tmp_path: Path) -> None:
    warned = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert warned.stderr.count("outbox (Flask): Celery's broker is memory://") == 1, warned.stderr
    assert "set OUTBOX_CELERY_BROKER_URL" in warned.stderr
    quiet = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                  OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert "outbox (Flask)" not in quiet.stderr
    off = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", OUTBOX_RELAY_WAKE="0")
    assert "outbox (Flask)" not in off.stderr


def test_django_warns_once_at_start_up(tmp_path: Path) -> None:
    env = {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}"}
    warned = start(DJANGO_APP, tmp_path, **env)
    assert warned.stderr.count("outbox (Django): Celery's broker is memory://") == 1, warned.stderr
    quiet = start(DJANGO_APP, tmp_path, **env, OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert "outbox (Django)" not in quiet.stderr
