"""Who sent a request to the gateway: its API key, what that key may do, and (for a stream
picked up again by ``GET /v1/stream/{id}``) the job its first request made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from api_client.gateway.errors import NotPermitted
from api_client.gateway.keys import ApiKey
from api_client.gateway.resume import Resume
from scheduler.errors import InvalidRequest
from scheduler.settings import Settings
from scheduler.units import parse_duration_s


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: its API key (None when keys are off), and the stream it picks
    up again, if it does (api_client/gateway/resume.py)."""

    key: ApiKey | None = None
    resume: Resume | None = None

    @property
    def tenant(self) -> str:
        return self.key.id if self.key else "default"

    @property
    def weight(self) -> float:
        return self.key.weight if self.key else 1.0

    @property
    def sees_all(self) -> bool:
        """An admin key, or no key (a keyless gateway): every tenant's jobs and batches."""
        return self.key is None or self.key.admin

    @property
    def only_tenant(self) -> str | None:
        """The one tenant whose jobs, batches and files the caller sees; None for all."""
        return None if self.sees_all else self.tenant

    def sees(self, tenant: str) -> bool:
        """Whether the caller sees the jobs, batches and files of ``tenant``."""
        return self.sees_all or tenant == self.tenant

    def check_model(self, model: str) -> None:
        if self.key is not None:
            self.key.check_model(model)

    def may_use(self, model: str) -> bool:
        """Whether listings show ``model`` to this caller (its key's allow-list)."""
        return self.key is None or not self.key.models or model in self.key.models

    def check_admin(self, what: str) -> None:
        """Only an admin key (or no key: a keyless gateway) may do ``what``."""
        if self.key is not None and not self.key.admin:
            raise NotPermitted(
                f"API key {self.key.id!r} may not {what}: that disturbs every tenant, and "
                "needs an admin key (`ggufq keys create --admin`)"
            )

    def check_job(
        self, options: dict[str, Any], keep_alive: str | float | None, settings: Settings
    ) -> None:
        """A non-admin key's job within its ceilings: no pin or unload by keep_alive, at
        most its max_keep_alive_s (GGUFQ_HTTP_MAX_KEEP_ALIVE_S), and num_ctx x num_parallel
        at most its max_context (GGUFQ_HTTP_MAX_CONTEXT)."""
        if self.key is None or self.key.admin:
            return
        if keep_alive is not None:
            try:
                seconds = parse_duration_s(keep_alive)
            except ValueError as exc:
                raise InvalidRequest(f"keep_alive: {exc}") from None
            if seconds < 0:
                self.check_admin("keep a model loaded for ever (keep_alive < 0)")
            if seconds == 0:
                self.check_admin("unload a model (keep_alive 0)")
            ceiling = self.key.max_keep_alive_s or settings.http_max_keep_alive_s
            if seconds > ceiling:
                raise NotPermitted(
                    f"keep_alive {keep_alive!r} is longer than API key {self.key.id!r} may ask "
                    f"for ({ceiling:g} s: the key's max_keep_alive_s, else "
                    "GGUFQ_HTTP_MAX_KEEP_ALIVE_S)"
                )
        ctx = int(options.get("num_ctx") or settings.num_ctx)
        slots = int(options.get("num_parallel") or 1)
        limit = self.key.max_context or settings.http_max_context
        if ctx * slots > limit:
            raise NotPermitted(
                f"num_ctx {ctx} x num_parallel {slots} is {ctx * slots:,} tokens; API key "
                f"{self.key.id!r} may ask for at most {limit:,} (a larger runner evicts other "
                "tenants' models): ask for less, or use a key with a larger max_context"
            )


def caller_of(request: Request) -> Caller:
    caller = getattr(request.state, "caller", None)
    return caller if isinstance(caller, Caller) else Caller()
