"""The serve config and the typed app builder: replicas, batching and limits come from YAML.

`build` is the Ray Serve application builder that declarative deployments name: a Serve config
file (`serve run` / `serve deploy`, KubeRay's RayService `serveConfigV2`) with

    import_path: lmfoundry.serving.app:build
    args: {checkpoint: s3://BUCKET/runs/gpt-125m, keys_file: s3://BUCKET/serve/keys.json}

where `args` holds the keys of configs/serve.yaml, or on the command line
`serve run lmfoundry.serving.app:build checkpoint=work/pretrain`. `serve build` takes an
application rather than a builder: `app` is the application of the recipe that
$LMFOUNDRY_SERVE_CONFIG names, `LMFOUNDRY_SERVE_CONFIG=my-serve.yaml serve build
lmfoundry.serving.app:app -o serve_config.yaml`. `lmfoundry serve` (start) is the laptop path on
top of the same app.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, model_validator

from lmfoundry.platform.config import ConfigError, StageConfig, build_config, read_recipe
from lmfoundry.platform.keys import ApiKeysConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracing import TracingConfig
from lmfoundry.safety.guardrails import GuardrailsConfig
from lmfoundry.serving.canary import CanaryConfig
from lmfoundry.serving.ratelimit import RateLimits

logger = get_logger(__name__)
SERVE_CONFIG_ENV = "LMFOUNDRY_SERVE_CONFIG"  # the recipe behind `app`, for `serve build`
# A replica being replaced (an upgrade, a scale-down) keeps answering its in-flight requests for
# up to their timeout, plus this margin, before Serve stops it.
DRAIN_MARGIN_S = 5.0


class PrefixCacheConfig(StageConfig):
    enabled: bool = Field(True, description="reuse the keys and values of a prompt prefix seen before")
    max_tokens: int = Field(
        16384, ge=1, description="prompt tokens kept (memory: this many positions of every layer's keys and values)"
    )
    block_tokens: int = Field(16, ge=1, le=1024, description="reuse comes in whole blocks of this many tokens")
    scope: Literal["tenant", "global"] = Field(
        "tenant",
        description="tenant: a prefix is reused only for the tenant that sent it; global: for every tenant "
        "(a tenant can then tell from the time to first token whether another sent the same prefix lately)",
    )

    @model_validator(mode="after")
    def _holds_a_block(self) -> PrefixCacheConfig:
        if self.max_tokens < self.block_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} must hold at least one block of {self.block_tokens}")
        return self


class EngineConfig(StageConfig):
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="weights and KV cache; bfloat16 halves both and runs faster on GPUs and on CPUs "
        "with AMX (benchmarks/serving.py), slower on CPUs without bfloat16 instructions",
    )
    max_batch_size: int = Field(16, ge=1, description="requests decoded together (KV-cache slots)")
    max_waiting: int = Field(64, ge=0, description="requests queued for a slot; beyond it: 503")
    max_prefill_tokens: int = Field(2048, ge=1, description="prompt tokens computed per scheduler step")
    prefix_cache: PrefixCacheConfig = Field(PrefixCacheConfig(), description="shared-prefix reuse (prefix_cache.py)")


class LimitsConfig(StageConfig):
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_n: int = Field(4, ge=1, le=8, description="choices per request")
    request_timeout_s: float = Field(120.0, gt=0, description="until the full reply (streams: the first token)")


class ModelVersion(StageConfig):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    checkpoint: str
    weight: float = Field(0.0, ge=0, description="share of traffic (relative to the other versions)")


class AutoscalingConfig(StageConfig):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="per replica; keep it near engine.max_batch_size")

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} is above max_replicas={self.max_replicas}")
        return self


class ServeConfig(ApiKeysConfig):
    checkpoint: str | None = Field(None, description="a checkpoint or a pretrain run directory (one version, 'main')")
    versions: list[ModelVersion] = Field([], description="several versions behind one route (gray release)")
    traffic_file: str | None = Field(None, description="`lmfoundry traffic` file overriding the versions' weights")
    model_name: str = "lmfoundry"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1, description="ignored when autoscaling is set")
    autoscaling: AutoscalingConfig | None = None
    max_ongoing_requests: int = Field(32, ge=1, description="per replica; keep it at least engine.max_batch_size")
    max_queued_requests: int = Field(64, ge=-1, description="waiting at the proxy beyond that: 503 (-1: no limit)")
    cpus_per_replica: float = Field(1.0, gt=0)
    gpus_per_replica: float = Field(0.0, ge=0)
    engine: EngineConfig = EngineConfig()
    limits: LimitsConfig = LimitsConfig()
    guardrails: GuardrailsConfig = GuardrailsConfig()
    rate_limits: RateLimits = RateLimits()
    force_gate_failed: bool = Field(False, description="serve checkpoints that failed their evaluation gate (logged)")
    tracing: TracingConfig = Field(TracingConfig(), description="a span per request (OTLP, JSON lines)")
    canary: CanaryConfig | None = Field(None, description="roll a worse canary back by itself (serving/canary.py)")
    reward_models: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,32}$")], str] = Field(
        {},
        max_length=8,
        description="name -> reward model checkpoint (lmfoundry reward): scorers that the `reasoning` "
        "extension of chat completions may name, beside 'verifier'",
    )

    @model_validator(mode="after")
    def _one_source_of_weights(self) -> ServeConfig:
        if (self.checkpoint is None) == (not self.versions):
            raise ValueError("give either checkpoint (one version) or versions (several), not both or neither")
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"versions: names must be unique, got {names}")
        if self.versions and sum(v.weight for v in self.versions) <= 0:
            raise ValueError("versions: at least one weight must be above 0")
        if self.canary is not None:
            unknown = sorted({self.canary.stable, self.canary.canary} - set(names))
            if unknown:
                raise ValueError(f"canary: {unknown} not among the versions served, {names}")
            if not self.traffic_file:
                raise ValueError("canary: needs traffic_file, where the rollback is written for every replica")
        if "verifier" in self.reward_models:
            raise ValueError("reward_models: 'verifier' names the built-in scorer; give the model another name")
        return self

    def served_versions(self) -> list[ModelVersion]:
        return self.versions or [ModelVersion(name="main", checkpoint=self.checkpoint, weight=1.0)]


def build_app(cfg: ServeConfig, env_key_digests: list[str]):
    from lmfoundry.platform import checkpoint
    from lmfoundry.serving.api import LLMServer
    from lmfoundry.serving.ratelimit import limiter_deployment

    versions = [
        {"name": v.name, "checkpoint": checkpoint.resolve(v.checkpoint), "weight": v.weight}
        for v in cfg.served_versions()
    ]  # a missing checkpoint fails here, not inside a replica
    for v in versions:  # and so does one that failed its evaluation gate, unless forced
        checkpoint.check_gate(v["checkpoint"], cfg.force_gate_failed, f"serve (version {v['name']})")
    reward_models = {name: checkpoint.resolve(path) for name, path in cfg.reward_models.items()}
    limiter = limiter_deployment().bind(cfg.rate_limits.model_dump()) if cfg.rate_limits.limited() else None
    guardrails = cfg.guardrails.harm.model_dump() if cfg.guardrails.enabled else None
    scale = (
        {"autoscaling_config": cfg.autoscaling.model_dump()} if cfg.autoscaling else {"num_replicas": cfg.num_replicas}
    )
    return LLMServer.options(
        **scale,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        graceful_shutdown_timeout_s=cfg.limits.request_timeout_s + DRAIN_MARGIN_S,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica},
    ).bind(
        versions,
        cfg.model_name,
        cfg.keys_file,
        env_key_digests,
        cfg.engine.model_dump(),
        cfg.limits.model_dump(),
        guardrails,
        cfg.traffic_file,
        limiter,
        env_key_roles=cfg.api_keys_env_roles,
        tracing=cfg.tracing.model_dump(),
        canary=cfg.canary.model_dump() if cfg.canary else None,
        reward_models=reward_models,
    )


def build(args: dict):
    """The Serve application builder (Serve calls it with the one argument, `args`): the keys of
    configs/serve.yaml. Keys come from `keys_file` and from $api_keys_env in the environment the
    application is built in (on Kubernetes, a Secret the pods read); with neither, it refuses to
    build, since a declarative deployment has nowhere to show a generated key."""
    return build_from(args, "the Serve application's args (lmfoundry.serving.app:build)")


def build_from(args: dict, source: str):
    """`build` for the serve config `args` read from `source` (named in errors)."""
    from lmfoundry.platform.keys import digest, env_keys

    if not isinstance(args, dict):
        raise ConfigError(
            f"the Serve application's args must be a mapping of serve config keys, not {type(args).__name__}"
        )
    cfg = build_config(ServeConfig, args, source=source)
    for key in ("host", "port"):
        if key in args:
            logger.warning("args: %r is ignored here; the Serve config's http_options set the proxy's address", key)
    digests = [digest(k) for k in env_keys(cfg.api_keys_env)]
    if not digests and not cfg.keys_file:
        raise ConfigError(
            f"{source}: no API keys: set keys_file, or ${cfg.api_keys_env} in the "
            "environment the application is built in (comma-separated keys)"
        )
    return build_app(cfg, digests)


def __getattr__(name: str):
    """`app`: the application of the recipe that $LMFOUNDRY_SERVE_CONFIG names, built when it is
    first asked for (`serve build lmfoundry.serving.app:app`), never at import."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = os.environ.get(SERVE_CONFIG_ENV)
    if not path:  # AttributeError, as for any missing attribute, with what to set
        raise AttributeError(
            f"lmfoundry.serving.app:app is the application of the serve recipe that ${SERVE_CONFIG_ENV} names; set it"
        )
    return build_from(read_recipe(path), path)


def start(cfg: ServeConfig) -> tuple[str, str | None]:
    """Deploy the app on the connected Ray cluster. Returns the base URL and, when neither a key
    file nor keys in the environment were given, the key generated for this server."""
    import secrets

    from ray import serve

    from lmfoundry.platform.keys import digest, env_keys

    keys = env_keys(cfg.api_keys_env)
    generated = None
    if not keys and not cfg.keys_file:
        generated = "sk-lmf-" + secrets.token_urlsafe(24)
        keys = [generated]
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg, [digest(k) for k in keys]), name="lmfoundry", route_prefix="/", blocking=False)
    return f"http://{cfg.host}:{cfg.port}", generated
