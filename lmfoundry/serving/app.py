"""The serve config and the typed app builder: replicas and limits come from YAML."""

from __future__ import annotations

from pydantic import Field

from lmfoundry.platform.config import StageConfig


class ServeConfig(StageConfig):
    checkpoint: str = Field(..., description="a checkpoint directory or a pretrain run directory")
    model_name: str = "lmfoundry"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(8, ge=1)
    cpus_per_replica: float = Field(1.0, gt=0)
    gpus_per_replica: float = Field(0.0, ge=0)
    api_keys_env: str = Field("LMFOUNDRY_API_KEYS", description="env var with comma-separated API keys")


def build_app(cfg: ServeConfig, key_digests: list[str]):
    from lmfoundry.platform import checkpoint
    from lmfoundry.serving.api import LLMServer

    ckpt = checkpoint.resolve(cfg.checkpoint)  # fail here, not inside a replica
    return LLMServer.options(
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica},
    ).bind(ckpt, cfg.model_name, key_digests)


def start(cfg: ServeConfig) -> tuple[str, str | None]:
    """Deploy the app on the connected Ray cluster. Returns the base URL and, when no API key
    was configured in the environment, the key generated for this server."""
    from ray import serve

    from lmfoundry.serving.auth import keys_from_env

    digests, generated = keys_from_env(cfg.api_keys_env)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg, digests), name="lmfoundry", route_prefix="/", blocking=False)
    return f"http://{cfg.host}:{cfg.port}", generated
