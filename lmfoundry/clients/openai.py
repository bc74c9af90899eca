"""The one OpenAI-compatible HTTP client: evaluation, alignment judges, agents and the quickstart
all talk to a served model (lmfoundry's or anyone's) through `OpenAIClient`.

`EndpointModel` answers the evaluation protocol (`clients/checkpoint.py: EvalModel`) over such an
endpoint: `complete` and `chat`, concurrently; log-likelihoods need a checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx

from lmfoundry.clients.checkpoint import Blocked, cut_at_stop


class EndpointError(RuntimeError):
    """An answer other than 200. `retryable` for overload (429) and server errors (5xx)."""

    def __init__(self, where: str, status: int, text: str):
        super().__init__(f"{where} answered {status}: {text[:300]}")
        self.status, self.text = status, text
        self.retryable = status == 429 or status >= 500


class ResponseRefused(RuntimeError):
    """A response this client would not read whole: larger than its byte cap, or still arriving
    when its deadline passed (a server that trickles bytes)."""


_TRANSFER_HEADERS = ("content-encoding", "content-length", "transfer-encoding")
MAX_RESPONSE_BYTES = 16 << 20  # far above any reply of max_tokens a client asks for


class OpenAIClient:
    """One model at one OpenAI-compatible base URL (without `/v1`), with an optional API key.

    An endpoint is not trusted to be well-behaved: a response is read up to `max_response_bytes`
    and must be whole within `timeout_s` of the request (each read is bounded by it too, so a
    server that sends nothing, or one byte at a time, costs at most about twice `timeout_s`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.timeout_s, self.max_response_bytes = timeout_s, max_response_bytes
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def post(self, path: str, body: dict) -> httpx.Response:
        """The raw response to a request for this client's model, read whole (within the byte
        cap and the deadline), for callers that read errors."""
        deadline = time.monotonic() + self.timeout_s
        with self.http.stream("POST", path, json={"model": self.model, **body}) as response:
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > self.max_response_bytes:
                    raise ResponseRefused(
                        f"{self.base_url}{path}: the response is larger than {self.max_response_bytes} bytes"
                    )
                if time.monotonic() > deadline:
                    raise ResponseRefused(f"{self.base_url}{path}: the response took longer than {self.timeout_s:g} s")
        # the body is decoded already: the headers that described its transfer no longer apply
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _TRANSFER_HEADERS]
        return httpx.Response(response.status_code, headers=headers, content=bytes(data), request=response.request)

    def _ok(self, path: str, body: dict) -> dict:
        response = self.post(path, body)
        if response.status_code != 200:
            raise EndpointError(f"{self.model} at {self.base_url}{path}", response.status_code, response.text)
        return response.json()

    def chat(self, messages: list[dict], **params) -> dict:
        """POST /v1/chat/completions; `params` are the request's other fields (max_tokens, tools, ...)."""
        return self._ok("/v1/chat/completions", {"messages": messages, **params})

    def complete(self, prompt: str, **params) -> dict:
        """POST /v1/completions."""
        return self._ok("/v1/completions", {"prompt": prompt, **params})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> OpenAIClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EndpointModel:
    """Any OpenAI-compatible endpoint (lmfoundry's own server, vLLM, a hosted API): chat and
    completions over HTTP, greedy, several requests in flight so a batching server batches them.
    Context lengths are counted with a local tokenizer file when one is given, else in words."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 120.0,
        tokenizer: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ):
        self.name = f"{base_url} ({model})"
        self.client = OpenAIClient(base_url, model, api_key, timeout_s, max_response_bytes)
        self.concurrency = concurrency
        self.errors: dict[str, int] = {}  # requests the endpoint refused as malformed, by answer
        self._lock = threading.Lock()
        self.tokenizer = None
        if tokenizer:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(tokenizer)

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(text.split())

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        raise ValueError(
            f"{self.name}: log-likelihood suites (multiple choice, calibration) need a checkpoint; "
            "an OpenAI-compatible endpoint does not return the log-probabilities of a given text"
        )

    def _post(self, path: str, body: dict) -> dict:
        response = self.client.post(path, {"temperature": 0.0, **body})  # greedy unless told
        if response.status_code == 400 and "content_policy_violation" in response.text:
            return {"choices": [{"text": "", "message": {"content": ""}, "finish_reason": "content_policy_violation"}]}
        if 400 <= response.status_code < 500 and response.status_code not in (401, 403, 404):
            # this request cannot be served (e.g. longer than the context): an empty reply, counted;
            # a suite goes on with the rest
            with self._lock:
                self.errors[f"{response.status_code}: {response.text[:120]}"] = (
                    self.errors.get(f"{response.status_code}: {response.text[:120]}", 0) + 1
                )
            return {"choices": [{"text": "", "message": {"content": ""}, "finish_reason": "error"}]}
        if response.status_code >= 400:
            raise RuntimeError(f"{self.name}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def _map(self, fn, items: list) -> list:
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(fn, items))

    def complete(self, prompts: list[str], max_tokens: int, stop: list[str] = ()) -> list[str]:
        def one(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": max_tokens, **({"stop": list(stop)[:4]} if stop else {})}
            choice = self._post("/v1/completions", body)["choices"][0]
            return _reply(cut_at_stop(choice["text"], list(stop)), choice)

        return self._map(one, prompts)

    def chat(self, conversations: list[list[dict]], max_tokens: int) -> list[str]:
        return self.sample(conversations, max_tokens, 0.0, None)

    def sample(
        self, conversations: list[list[dict]], max_tokens: int, temperature: float, seed: int | None
    ) -> list[str]:
        def one(item: tuple[int, list[dict]]) -> str:
            i, messages = item
            body = {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": temperature,
                **({"seed": seed + i} if seed is not None else {}),
            }
            choice = self._post("/v1/chat/completions", body)["choices"][0]
            return _reply((choice["message"].get("content") or "").strip(), choice)

        return self._map(one, list(enumerate(conversations)))


def _reply(text: str, choice: dict) -> str:
    blocked = choice.get("finish_reason") in ("content_filter", "content_policy_violation")
    return Blocked(text) if blocked else text
