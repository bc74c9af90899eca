"""From an OpenAI request to what the engine runs: the sampling parameters of each choice and
the JSON schema its reply is decoded under. The checks that need the served model (the
vocabulary, the context) are here; the shape checks are in protocol.py."""

import dataclasses

from lmfoundry.serving.errors import ApiError
from lmfoundry.serving.grammar import SchemaRefused, check_schema, tool_call_schema
from lmfoundry.serving.protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from lmfoundry.serving.sampling import SamplingParams


def sampling_params(req, vocab_size: int, stop: list[str]) -> SamplingParams:
    """The request's parameters; `for_choice` gives each choice its token budget and seed."""
    bias = req.bias_ids()
    outside = [t for t, _ in bias if t >= vocab_size]
    if outside:
        raise ApiError(
            400,
            f"logit_bias: token id {outside[0]} is outside the vocabulary (0 to {vocab_size - 1})",
            param="logit_bias",
        )
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        # echo with logprobs scores the prompt; max_tokens=0 is only for that, so it always does
        prompt_logprobs = logprobs if req.echo and logprobs is not None else (0 if req.max_tokens == 0 else None)
    return SamplingParams(
        max_tokens=req.max_tokens or 0,  # until for_choice sets the budget of the prompt
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=tuple(stop),
    )


def for_choice(params: SamplingParams, budget: int, index: int) -> SamplingParams:
    """Choice `index`, which may generate `budget` tokens. A request's seed makes its choices
    reproducible, each with a sequence of its own (seed + index)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, max_tokens=budget, seed=seed)


def reply_schema(req) -> tuple[dict | None, str]:
    """(the JSON schema the reply is decoded under or None, the field it comes from), its static
    limits checked before anything is rendered or tokenized."""
    if isinstance(req, ChatCompletionRequest) and req.forced_tool()[0]:
        schema, field = tool_call_schema(req.tools_offered(), req.forced_tool()[1]), "tools"
    else:
        schema, field = req.reply_schema(), "response_format"
    if schema is not None:
        try:
            check_schema(schema)
        except SchemaRefused as e:
            raise ApiError(400, f"{field}: {e}", param=field, code="invalid_schema") from None
    return schema, field


def check_choice_count(req: CompletionRequest) -> None:
    """Every prompt's n choices share the batch: a request's choices, all prompts together, are
    as many as its prompts may be."""
    total = len(req.prompts()) * req.n
    if total > MAX_PROMPTS:
        raise ApiError(
            400, f"{len(req.prompts())} prompts x n={req.n} is {total} choices; the limit is {MAX_PROMPTS}", param="n"
        )
