"""Per-tenant rate limits: requests and tokens per minute, as token buckets.

A request is charged its prompt tokens plus the tokens it may generate (max_tokens x n) when it
is admitted, as OpenAI counts against a limit, and the tokens it did not use are refunded when
it ends. A refused request is told how many seconds until it would fit (`Retry-After`).

The buckets live in one place for all ingress replicas: `RateLimiter` is a one-replica Serve
deployment that every API replica calls, so a tenant's limit holds however requests are routed.
"""

from __future__ import annotations

import math
import time

from pydantic import Field

from lmfoundry.platform.config import StageConfig


class TenantLimit(StageConfig):
    requests_per_minute: int | None = Field(None, ge=1, description="None: unlimited")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + max_tokens x n; None: unlimited")


class RateLimits(StageConfig):
    default: TenantLimit = TenantLimit()
    tenants: dict[str, TenantLimit] = {}

    def limited(self) -> bool:
        every = [self.default, *self.tenants.values()]
        return any(t.requests_per_minute or t.tokens_per_minute for t in every)


class Bucket:
    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0: now)."""
        self._fill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class TenantBuckets:
    """The limiter itself, a plain class (tested without Ray)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic):
        self.limits = limits
        self.clock = clock
        self._buckets: dict[tuple[str, str], Bucket] = {}

    def _bucket(self, tenant: str, kind: str) -> Bucket | None:
        limit = getattr(self.limits.tenants.get(tenant, self.limits.default), kind)
        if limit is None:
            return None
        key = (tenant, kind)
        if key not in self._buckets:
            self._buckets[key] = Bucket(limit, self.clock())
        return self._buckets[key]

    def admit(self, tenant: str, tokens: int) -> tuple[float, str]:
        """(0, "") when admitted and charged; else (seconds to wait, why). A request larger than
        the tenant's whole minute of tokens never fits: (inf, why)."""
        now = self.clock()
        requests = self._bucket(tenant, "requests_per_minute")
        token_bucket = self._bucket(tenant, "tokens_per_minute")
        if token_bucket is not None and tokens > token_bucket.capacity:
            return math.inf, (
                f"the request may use {tokens} tokens (prompt + max_tokens x n), more than "
                f"tenant {tenant!r}'s limit of {int(token_bucket.capacity)} tokens per minute"
            )
        waits = []
        if requests is not None and (w := requests.wait_for(1, now)) > 0:
            waits.append((w, f"tenant {tenant!r} is over its {int(requests.capacity)} requests per minute"))
        if token_bucket is not None and (w := token_bucket.wait_for(tokens, now)) > 0:
            waits.append((w, f"tenant {tenant!r} is over its {int(token_bucket.capacity)} tokens per minute"))
        if waits:
            return max(waits)
        if requests is not None:
            requests.take(1)
        if token_bucket is not None:
            token_bucket.take(tokens)
        return 0.0, ""

    def refund(self, tenant: str, tokens: int) -> None:
        bucket = self._bucket(tenant, "tokens_per_minute")
        if bucket is not None and tokens > 0:
            bucket.give(tokens)


def limiter_deployment():
    """The Serve deployment that holds the buckets (imported lazily: Ray is not needed to test them)."""
    from ray import serve

    @serve.deployment(name="RateLimiter", num_replicas=1, ray_actor_options={"num_cpus": 0})
    class RateLimiter:
        def __init__(self, limits: dict):
            self.buckets = TenantBuckets(RateLimits.model_validate(limits))

        def admit(self, tenant: str, tokens: int) -> tuple[float, str]:
            return self.buckets.admit(tenant, tokens)

        def refund(self, tenant: str, tokens: int) -> None:
            self.buckets.refund(tenant, tokens)

        def check_health(self) -> None:  # nothing can go stale here; Serve restarts a dead replica
            return None

    return RateLimiter
