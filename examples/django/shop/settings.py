"""Settings of the example shop. The database comes from DATABASE_URL (default: SQLite
next to manage.py); the relay reads its OUTBOX_* settings from here or the environment and,
with no OUTBOX_DATABASE_URL, uses DATABASES["default"] (the same database, as it must:
the event commits with the order)."""

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-shop-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "outbox.contrib.django",
    "orders",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
WSGI_APPLICATION = "shop.wsgi.application"
STATIC_URL = "static/"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_ENGINES = {"sqlite": "django.db.backends.sqlite3", "postgresql": "django.db.backends.postgresql",
            "mysql": "django.db.backends.mysql", "mssql": "mssql"}


def _database(url: str) -> dict:
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme == "sqlite":
        return {"ENGINE": _ENGINES["sqlite"], "NAME": url.split("sqlite:///", 1)[1]}
    db = {"ENGINE": _ENGINES[scheme], "NAME": unquote(parts.path.lstrip("/")), "USER": unquote(parts.username or ""),
          "PASSWORD": unquote(parts.password or ""), "HOST": parts.hostname or "", "PORT": str(parts.port or "")}
    if os.environ.get("DJANGO_TEST_DATABASE_NAME"):  # a test database of our own on a shared server
        db["TEST"] = {"NAME": os.environ["DJANGO_TEST_DATABASE_NAME"]}
    if scheme == "mssql":
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        db["OPTIONS"] = {"driver": query.pop("driver", "ODBC Driver 18 for SQL Server"),
                         "extra_params": ";".join(f"{k}={v}" for k, v in query.items())}
    return db


DATABASES = {"default": _database(os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"))}

# The relay's settings, like any Django setting (the environment wins; README.md here).
# Celery's broker: the web process wakes the relay through it right after each commit, so it
# must be the workers' own. Left unset with the SQLite default, one `celery -A outbox worker`
# relays on its own (Celery's in-process broker) and the web process says once that it
# cannot wake it: events then go out on beat's next tick.
OUTBOX_CELERY_BROKER_URL = os.environ.get("SHOP_CELERY_BROKER_URL")  # e.g. redis://127.0.0.1:6379/0
OUTBOX_PUBLISH_URL = os.environ.get("SHOP_PUBLISH_URL")  # e.g. amqp://guest:guest@127.0.0.1:5672//
