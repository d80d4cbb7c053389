"""The commands of the HTTP gateway: serve, and keys (create, list, revoke)."""

from __future__ import annotations

import argparse
import json
import time

from api_client.cli.tables import print_table
from api_client.gateway.keys import KeyStore
from api_client.gateway.server import add_serve_arguments, serve
from scheduler.settings import get_settings
from scheduler.store.connection import connect_typed, resolve_redis_url
from scheduler.units import parse_duration_s


def cmd_serve(args: argparse.Namespace) -> int:
    serve(args.host, args.port, args.log_level)
    return 0


def add_keys_commands(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(metavar="ACTION", required=True)
    create = sub.add_parser("create", help="make a key; its token is printed once")
    create.add_argument("--name", default="", help="whom the key is for (shown in listings)")
    create.add_argument(
        "--model",
        action="append",
        default=[],
        dest="models",
        help="a model the key may use (repeatable; none given: every model)",
    )
    create.add_argument(
        "--max-in-flight", type=int, default=32, help="requests at once (32; 0: any number)"
    )
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: any)")
    create.add_argument(
        "--weight",
        type=float,
        default=1.0,
        help="its share while other keys' jobs wait too (2: twice the turns of a key of 1)",
    )
    create.add_argument(
        "--admin",
        action="store_true",
        help="may unload and pin models (keep_alive 0 or < 0) and ask past the ceilings",
    )
    create.add_argument(
        "--max-context",
        type=int,
        default=0,
        help="num_ctx x num_parallel at most (0: GGUFQ_HTTP_MAX_CONTEXT)",
    )
    create.add_argument(
        "--max-keep-alive",
        type=parse_duration_s,
        default=0.0,
        help="the longest keep_alive it may ask for, e.g. 10m (0: GGUFQ_HTTP_MAX_KEEP_ALIVE_S)",
    )
    create.set_defaults(func=cmd_keys_create)
    listing = sub.add_parser("list", help="list the keys (never their tokens)")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_keys_list)
    revoke = sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)
    migrate = sub.add_parser(
        "migrate", help="copy keys made before ggufq-auth:* into it (once, after upgrading)"
    )
    migrate.add_argument(
        "--remove-old",
        action="store_true",
        help="and remove the old records (every gateway upgraded)",
    )
    migrate.set_defaults(func=cmd_keys_migrate)


def _store() -> KeyStore:
    settings = get_settings()
    return KeyStore(connect_typed(resolve_redis_url(settings)), settings.http_key_secret)


def cmd_keys_create(args: argparse.Namespace) -> int:
    store = _store()
    key, token = store.create(
        args.name,
        args.models,
        args.max_in_flight,
        args.rpm,
        args.weight,
        admin=args.admin,
        max_context=args.max_context,
        max_keep_alive_s=args.max_keep_alive,
    )
    print(f"created key {key.id}; its token (shown once, keep it secret):")
    print(token)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    keys = _store().list()
    if args.json:
        print(json.dumps([k.__dict__ for k in keys], indent=2))
        return 0
    rows = [
        (
            k.id,
            k.name or "-",
            ",".join(k.models) or "all",
            str(k.max_in_flight or "-"),
            str(k.rpm or "-"),
            f"{k.weight:g}",
            "admin" if k.admin else "-",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at)),
        )
        for k in keys
    ]
    print_table(["ID", "NAME", "MODELS", "IN FLIGHT", "RPM", "WEIGHT", "SCOPE", "CREATED"], rows)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    if not _store().revoke(args.key_id):
        print(f"no key {args.key_id!r}; `ggufq keys list` shows the ids")
        return 1
    print(f"revoked key {args.key_id}")
    return 0


def cmd_keys_migrate(args: argparse.Namespace) -> int:
    copied = _store().migrate(remove_old=args.remove_old)
    removed = "; the old records are removed" if args.remove_old else ""
    print(f"copied {copied} key{'' if copied == 1 else 's'} into their own keyspace{removed}")
    return 0


__all__ = ["add_keys_commands", "add_serve_arguments", "cmd_serve"]
