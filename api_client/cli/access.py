"""``ggufq acl``: Redis ACL users for a deployment, one per role (scheduler/store/acl.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scheduler.errors import InvalidRequest
from scheduler.store.acl import Role, Users

ENV_NAMES = {role: f"GGUFQ_{role.value.upper()}_PASSWORD" for role in Role}


def add_acl_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        default=Path("redis-users.acl"),
        help="the ACL file to write for redis-server --aclfile (redis-users.acl)",
    )
    p.add_argument(
        "--redis-major",
        type=int,
        choices=[6, 7, 8],
        default=7,
        help="Redis's major version (7): Redis 6 has no read-only key patterns",
    )
    p.add_argument("--db", type=int, default=0, help="the database ggufq uses (0)")


def cmd_acl(args: argparse.Namespace) -> int:
    """Write the ACL file (password digests only) and print the passwords as .env lines.
    The administrator's is REDIS_PASSWORD when set (compose's), else a new one."""
    out: Path = args.out
    if out.is_dir():
        raise InvalidRequest(f"--out {out} is a directory; name the file to write")
    if not 0 <= args.db <= 15:
        raise InvalidRequest(f"--db must be 0 to 15 (Redis's default databases); got {args.db}")
    users = Users.fresh(admin=os.environ.get("REDIS_PASSWORD") or None)
    out.write_text(users.acl_file(args.redis_major, args.db))
    lines = [
        f"# Redis ACL users: {out} holds their digests (redis-server --aclfile)",
        f"REDIS_PASSWORD={users.admin}",
        *(f"{ENV_NAMES[role]}={password}" for role, password in users.roles.items()),
    ]
    print("\n".join(lines))
    print(
        f"wrote {out}; append the lines above to .env (docker compose reads them)", file=sys.stderr
    )
    return 0
