#!/bin/sh
# The relay image's entrypoint: one image, one verb per container.
#   worker [celery options]   celery -A outbox worker (as many as you need)
#   beat [celery options]     celery -A outbox beat (exactly one); its schedule file goes to
#                             $BEAT_SCHEDULE_FILE (default /var/lib/outbox/celerybeat-schedule),
#                             a writable volume: the image's /app is read-only to the relay user
#   migrate                   outbox migrate (a one-shot the workers wait for)
#   check                     outbox check (configuration, database, table, brokers, exchange)
#   anything else             run as given (outbox status, a shell...)
# Nothing is written to the working directory, so the container may run with a read-only
# root filesystem and an unprivileged user.
set -eu

verb="${1:-worker}"
[ "$#" -gt 0 ] && shift
case "$verb" in
  worker)  exec celery -A outbox worker --loglevel="${LOGLEVEL:-INFO}" "$@" ;;
  beat)    exec celery -A outbox beat --loglevel="${LOGLEVEL:-INFO}" \
             --schedule "${BEAT_SCHEDULE_FILE:-/var/lib/outbox/celerybeat-schedule}" "$@" ;;
  migrate) exec outbox migrate "$@" ;;
  check)   exec outbox check "$@" ;;
  *)       exec "$verb" "$@" ;;
esac
