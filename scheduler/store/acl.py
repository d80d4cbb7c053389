"""Redis ACL users, one per role of a ggufq process, so that one password is not the whole
trust domain: what each role may run and which keys and channels it may touch.

Every role is refused Redis's administrative and dangerous commands (CONFIG, ACL, FLUSHALL,
KEYS, DEBUG, SHUTDOWN, MODULE ...). Past that:

- ``placement`` and ``worker`` touch the cluster's keys (``ggufq:*``, the Celery queues
  ``ggufq.*``, kombu's bookkeeping, results) and never the API keys' records;
- ``gateway`` touches the cluster's keys and the API keys' records (``ggufq-auth:*``, see
  :data:`scheduler.store.keys.AUTH_PREFIX`), which it reads and counts in but cannot mint:
  records are signed with GGUFQ_HTTP_KEY_SECRET, which Redis never sees;
- ``monitor`` (Flower) reads queue lengths and kombu's bindings, follows Celery's events and
  asks workers for their state through the pidbox; it reads no job, prompt or key record.
  On Redis 7 its reads of the queues are read-only (``%R~``); Redis 6 has no read-only key
  patterns, so there it could also take, put or copy a queue's messages (run Redis 7 where
  that matters: compose does).

The default user is the administrator (``ggufq keys``, ``ggufq up`` itself). Passwords go
into the ACL file as SHA-256 digests, so the file holds no secret.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from scheduler.store.keys import AUTH_PREFIX, PREFIX


class Role(StrEnum):
    PLACEMENT = "placement"
    WORKER = "worker"
    GATEWAY = "gateway"
    MONITOR = "monitor"


# Celery's and kombu's names on the Redis transport: queues (ggufq.<device>, with their
# priority variants), kombu's exchange bindings and unacked bookkeeping, Celery's results,
# pidbox reply queues; channels: ggufq's own, Celery's result notices, kombu's fanout
# exchanges (``/<db>.<exchange>``: events and the pidbox)
CLUSTER_KEYS = (
    f"{PREFIX}:*",
    f"{PREFIX}.*",
    "celery",
    "celery-task-meta-*",
    "_kombu.*",
    "unacked*",
    "*.celery.pidbox*",
)
CHANNELS = (f"{PREFIX}:*", "celery-task-meta-*")


def fanout_channels(db: int) -> tuple[str, ...]:
    """kombu's fanout exchanges on database ``db``: publishing matches ``/<db>.*``, and
    PSUBSCRIBE must name an allowed pattern literally (the pidbox's, the events')."""
    return (f"/{db}.*", f"/{db}.celery.pidbox", f"/{db}.celeryev/*", f"/{db}.celeryev/#")


# scripts (a script's commands obey the same rules), not SCRIPT FLUSH or KILL, nor FUNCTION
_SCRIPTS = ("+eval", "+evalsha", "+script|load", "+script|exists")
# what a service may run: data commands of every type, pub/sub, transactions and scripts
_SERVICE_COMMANDS = (
    "-@all",
    "+@read",
    "+@write",
    "+@keyspace",
    "+@list",
    "+@hash",
    "+@set",
    "+@sortedset",
    "+@string",
    "+@stream",
    "+@pubsub",
    "+@transaction",
    "+@connection",
    *_SCRIPTS,
)
# the monitor: queue lengths, bindings, events, the pidbox's broadcast and its replies
_MONITOR_COMMANDS = (
    "-@all",
    "+@connection",
    "+@pubsub",
    "+llen",
    "+smembers",
    "+scard",
    "+sadd",
    "+srem",
    "+exists",
    "+type",
    "+brpop",
    "+rpop",
    "+lpush",
    "+del",
    "+expire",
    "+multi",
    "+exec",
    "+discard",
    "+zadd",
    "+zrangebyscore",
    "+zrem",
    "+select",  # Redis 6 files it under "keyspace" only
    *_SCRIPTS,  # kombu binds by script
)
# after the refusals: what every role needs that Redis files under "dangerous" or "admin"
_ALSO = ("+info", "+time")
# Redis 6 files all of CLIENT under "admin", and takes any subcommand name in a rule: a
# connection's own subcommands, by name (redis-py announces itself with CLIENT SETINFO and
# asks for CLIENT MAINT_NOTIFICATIONS on each connection; refused, that is ignored, but
# Redis logs it). Redis 7 files them under "connection", and refuses a name it lacks.
_CLIENT_6 = tuple(
    f"+client|{sub}" for sub in ("setname", "getname", "id", "setinfo", "maint_notifications")
)
_REFUSED = ("-@admin", "-@dangerous")


def rules(role: Role, redis_major: int = 7, db: int = 0) -> list[str]:
    """The ACL rules of ``role`` (without its password), for a Redis of ``redis_major``
    whose database ``db`` ggufq uses; ``redis_major`` 0 (not known): rules that load on
    Redis 6 and 7 alike, without what only one of them has."""
    if role is Role.MONITOR:
        # its own: the pidbox's replies to it, its event receiver's queue, and the binding
        # tables of those exchanges (never a job queue's: a binding there would copy jobs)
        write = (
            "*.reply.celery.pidbox*",
            "celeryev.*",
            *(
                f"_kombu.{table}.{x}"
                for table in ("binding", "binding_permanent")
                for x in ("reply.celery.pidbox", "celeryev", "celery.pidbox")
            ),
            "_kombu.binding_deadlines",
        )
        read = (f"{PREFIX}.*", "celery", "_kombu.*")  # queue lengths, bindings
        prefix = "%R~" if redis_major >= 7 else "~"
        keys = [*(prefix + k for k in read), *("~" + k for k in write)]
        channels = fanout_channels(db)  # Celery's events and the pidbox: no job's tokens
        commands: tuple[str, ...] = _MONITOR_COMMANDS
    else:
        extra = (f"{AUTH_PREFIX}:*",) if role is Role.GATEWAY else ()
        keys = ["~" + k for k in (*CLUSTER_KEYS, *extra)]
        channels = (*CHANNELS, *fanout_channels(db))
        commands = _SERVICE_COMMANDS
    return [
        "resetkeys",
        *keys,
        "resetchannels",
        *("&" + c for c in channels),
        *commands,
        *_REFUSED,
        *_ALSO,
        *(_CLIENT_6 if redis_major == 6 else ()),
    ]


def digest(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True)
class Users:
    """The passwords of the administrator (Redis's default user) and of each role."""

    admin: str
    roles: dict[Role, str]

    @classmethod
    def fresh(cls, admin: str | None = None) -> Users:
        return cls(
            admin=admin if admin is not None else secrets.token_urlsafe(24),
            roles={role: secrets.token_urlsafe(24) for role in Role},
        )

    def acl_file(self, redis_major: int = 7, db: int = 0) -> str:
        """What redis-server's ``aclfile`` holds: one ``user`` line each, passwords as
        digests. An empty admin password leaves the default user without one."""
        admin = f"#{digest(self.admin)}" if self.admin else "nopass"
        lines = [f"user default on {admin} ~* &* +@all"]
        for role, password in self.roles.items():
            rule = " ".join(rules(role, redis_major, db))
            lines.append(f"user {role.value} on #{digest(password)} {rule}")
        return "\n".join(lines) + "\n"

    def url(self, base_url: str, role: Role) -> str:
        """``base_url`` (host, port, database, options) with the credentials of ``role``."""
        return with_credentials(base_url, role.value, self.roles[role])


def with_credentials(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    where = f"{host}:{parts.port}" if parts.port else host
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if user or password else ""
    return urlunsplit(parts._replace(netloc=auth + where))


def refused(exc: Exception) -> bool:
    """Whether a Redis error is its ACL refusing the connection's user something (also from
    inside a script, where it comes back as a plain script error)."""
    text = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and ("no permissions" in text or "user executing the script can't" in text)
    )
