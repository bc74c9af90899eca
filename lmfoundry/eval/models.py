"""The models a suite talks to besides the one under test (a red team's attacker, a generative
judge): an OpenAI-compatible endpoint or a checkpoint on this machine, named in a config."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pydantic import Field, model_validator

from lmfoundry.clients.checkpoint import CheckpointModel, EvalModel
from lmfoundry.clients.openai import EndpointModel
from lmfoundry.platform import checkpoint
from lmfoundry.platform.config import StageConfig


class EndpointConfig(StageConfig):
    url: str = Field(..., description="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    model: str
    api_key_env: str | None = Field(None, description="environment variable holding the API key")
    concurrency: int = Field(8, ge=1)
    tokenizer: str | None = Field(None, description="tokenizer.json to count context lengths with")

    def open(self) -> EndpointModel:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if self.api_key_env and not key:
            raise ValueError(f"endpoint.api_key_env: environment variable {self.api_key_env} is not set")
        return EndpointModel(self.url, self.model, key, self.concurrency, tokenizer=self.tokenizer)


class ModelRef(StageConfig):
    """Exactly one of an endpoint and a checkpoint."""

    endpoint: EndpointConfig | None = None
    checkpoint: str | None = Field(None, description="a checkpoint directory or a pretrain run directory")
    batch_size: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _one(self):
        if (self.endpoint is None) == (self.checkpoint is None):
            raise ValueError("set exactly one of endpoint (an OpenAI-compatible server) and checkpoint")
        return self


@contextlib.contextmanager
def opened(ref: ModelRef) -> Iterator[EvalModel]:
    if ref.endpoint is not None:
        yield ref.endpoint.open()
        return
    with checkpoint.opened(checkpoint.resolve(ref.checkpoint), model_only=True) as (local, _):
        yield CheckpointModel(local, ref.batch_size)
