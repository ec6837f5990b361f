"""OpenAI's request schema and error, as `ygg serve` takes and answers them."""

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered in OpenAI's JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> "JSONResponse":
        from fastapi.responses import JSONResponse

        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ------------------------------------------------------------------ requests (OpenAI's schema)


class BaseRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI's
    clients send some (user, logit_bias at its default) that change nothing here."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, description="tokens to generate at most (default 16; chat: up to the context)")
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens tokens whatever the eos
    method: str | None = None  # Yggdrasil's extra: a compiled method (default: the artifact's)
    sampling: str | None = None  # Yggdrasil's extra: coupled or rejection at temperature > 0 (default: the artifact's)
    return_token_ids: bool = False  # vLLM's extra: the prompt's and the output's token ids in the response


class CompletionRequest(BaseRequest):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None


class ChatRequest(BaseRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None
