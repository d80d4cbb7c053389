"""kombu's Redis transport, with one change: a queue item that is not a message (not JSON,
or not an envelope) is logged and dropped. kombu's own raises out of the consumer's event
loop, and Celery then stops the whole worker ("Unrecoverable error") over one bad item."""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger("ggufq.transport")
_NOT_A_MESSAGE = (ValueError, TypeError, KeyError, AttributeError)


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        except _NOT_A_MESSAGE as exc:  # the item was already popped: nothing to put back
            log.error("dropped a queue item that is not a Celery message: %r", exc)
            return True


class Transport(kombu_redis.Transport):
    Channel = Channel
