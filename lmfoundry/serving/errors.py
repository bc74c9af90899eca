"""The API's refusals: an OpenAI-shaped error with a 4xx status (503 when the server is full)."""


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


def overloaded(why: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(
        503,
        f"{why}; retry shortly",
        "server_overloaded",
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )
