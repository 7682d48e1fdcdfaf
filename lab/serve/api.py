"""OpenAI's API as this server takes it: the request and error shapes, reading and checking a body (413 over the
limit, 400 naming the field for one not JSON, nested too deeply, with an unknown field or a value out of range).
"""

import json
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: SmolLM2's whole context, 8,192 tokens, is about 40 KB of text, 60 KB of ids

# ---- requests, as OpenAI's API shapes them ----
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is an error, "5" is not 5


class StreamOptions(Strict):
    include_usage: bool = False                # a last chunk with the usage and no choices


class Sampling(Strict):
    """The fields both endpoints take. `n` answers to one prompt share its prefill and its pages (the engine
    forks them); `temperature` > 0 samples, each answer with a generator of its own, seeded `seed` + its
    index when a seed is given. Accepted and ignored: `user`; `top_p` only as 1 (or absent) when sampling."""

    model: str | None = None                   # if given, the served model's name
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)   # 0 or absent: greedy decoding (OpenAI's range)
    top_p: float | None = Field(None, gt=0, le=1)  # the smallest set of tokens whose probability reaches top_p
    n: int = Field(1, ge=1, le=128)            # choices per request (OpenAI's limit is 128)
    stop: str | list[str] | None = None        # only None: the model's eos token stops, no stop strings
    user: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**62)
    return_token_ids: bool = False             # vLLM's extension: prompt_token_ids and token_ids in choices
    use_beam_search: bool = False              # vLLM's extension: n beams, the n best hypotheses as choices
    length_penalty: float = Field(1.0, ge=-10, le=10)   # beam search: score = log-prob sum / length ** this
    early_stopping: bool = False               # beam search: stop once n hypotheses are finished


class CompletionRequest(Sampling):
    prompt: str | list[int]                    # text, or token ids
    max_tokens: int = Field(16, ge=1)          # OpenAI's default for completions


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # default: as many as the context and pool allow
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens


class APIError(Exception):
    """An error answered as OpenAI answers it: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param=None, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, dict(message=message, type=type, param=param, code=code)

    def response(self, headers=None) -> JSONResponse:
        return JSONResponse({"error": self.body}, status_code=self.status, headers=headers)


def server_error(e: Exception) -> APIError:
    return APIError(500, f"{type(e).__name__}: {e}", type="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; APIError (413) once it is over `limit` bytes, by its Content-Length before
    anything is read, or while it arrives (a chunked body has none)."""
    too_large = APIError(413, f"the body is over this server's limit of {limit:,} bytes "
                              "(python -m lab.serve --max-body-bytes)", code="body_too_large")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def parse(raw: bytes, schema):
    """The request body checked against `schema`; APIError (400) naming what is wrong."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the body is not valid JSON here: it is nested too deeply") from None
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        unknown = [err["loc"][0] for err in errors if err["type"] == "extra_forbidden"]
        if unknown:
            raise APIError(400, f"unknown field(s): {', '.join(map(str, unknown))}", param=unknown[0]) from None
        where = lambda err: ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, "; ".join(f"{where(err)}: {err['msg']}" for err in errors),
                       param=str(errors[0]["loc"][0]) if errors[0]["loc"] else None) from None
    if req.use_beam_search and (req.temperature or req.stream):
        raise APIError(400, "beam search is greedy and answers when the search ends: temperature must be 0 or "
                            "absent, and stream false", param="temperature" if req.temperature else "stream")
    if req.temperature and req.top_p not in (None, 1):
        raise APIError(400, f"top_p must be 1 or absent when sampling, got {req.top_p}: this server samples "
                            "from the whole distribution", param="top_p")
    if req.stop is not None:
        raise APIError(400, "stop sequences are not supported: a request stops at the model's eos token or "
                            "at max_tokens", param="stop")
    return req
