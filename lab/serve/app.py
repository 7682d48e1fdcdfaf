"""The HTTP app (FastAPI): OpenAI's /v1/completions, /v1/chat/completions, /v1/models, /health, and /fleet.

A handler tokenizes on a worker thread (a long prompt never stalls other streams), sends the ids to the engine's
loop and awaits its tokens. A client that goes away has its request cancelled, freeing its pages. When the engine
fails, the requests in flight fail, a streamed one with an error event and [DONE] (as vLLM does), another with a
500; once the engine's process ended, /health and new requests get 503.
"""

import asyncio
import contextlib
import json
import time
import uuid

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..cache import OutOfPagesError
from ..engine import ServingEngine
from ..models import InputError, PositionLimitError
from .api import MAX_BODY_BYTES, APIError, ChatRequest, CompletionRequest, parse, read_body, server_error
from .client import EngineClient, EngineFailed
from .detokenizer import IncrementalDetokenizer
from .engine_loop import EngineThread
from .fleet import Fleet


def create_app(engine: "ServingEngine | EngineClient | Fleet", name: str | None = None, eos_id: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The HTTP app over `engine`, serving its model as `name` (default: the model's name). A request stops at
    `eos_id` (default: the tokenizer's eos token, if it has one) or at its max_tokens. A ServingEngine is stepped
    by an EngineThread that starts and stops with the app; an EngineClient or a Fleet given instead is started by
    the caller, and the app's shutdown stops it. `app.state.draining = True` refuses new requests (503)."""
    client = EngineClient(EngineThread(engine)) if isinstance(engine, ServingEngine) else engine
    config, tok = client.config, client.tokenizer
    name = name or client.name
    if eos_id is None:                                # SmolLM2's <|im_end|>; the random models have none
        eos = getattr(tok, "special", {}).get("eos_token")
        eos_ids = tok.encode(eos) if eos else []
        eos_id = eos_ids[0] if len(eos_ids) == 1 else None
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if client is not engine:
            client.start()
        yield
        client.stop()

    app = FastAPI(title="Inference Lab", lifespan=lifespan)
    app.state.loop, app.state.draining = client, False

    def refuse_if_unavailable():
        if app.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
        if not client.alive:
            raise APIError(503, f"the engine is gone: {client.failure}", code="engine_failed", type="server_error")

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)             # 404, 405: FastAPI's statuses, OpenAI's body
    async def http_error(request, e: HTTPException):
        return APIError(e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404
                        else "invalid_request_error").response(e.headers)

    @app.exception_handler(Exception)                 # a bug (the engine's loop failed): 500, OpenAI's body
    async def bug(request, e: Exception):
        return server_error(e).response()

    @app.get("/health")
    async def health():
        refuse_if_unavailable()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [dict(id=name, object="model", created=started, owned_by="inference-lab",
                                                max_model_len=config.max_positions)]}

    if isinstance(client, Fleet):
        @app.get("/fleet")
        async def fleet():                                # asks each worker's loop: off the event loop
            return await asyncio.to_thread(client.snapshot)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await read_body(request, max_body_bytes), CompletionRequest)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(tok.encode, req.prompt)   # off the event loop: others keep streaming
        else:
            ids = req.prompt
            if bad := [i for i in ids if not 0 <= i < config.vocab_size]:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary of {name} (valid ids "
                                    f"are 0 .. {config.vocab_size - 1})", param="prompt")
        return await respond(request, req, ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(await read_body(request, max_body_bytes), ChatRequest)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        render = lambda: tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        try:
            ids = await asyncio.to_thread(render)                   # off the event loop, as above
        except (ValueError, jinja2.TemplateError) as e:       # no template, or the template refused
            raise APIError(400, f"cannot render the conversation for {name}: {e}", param="messages") from None
        limit = min(config.max_positions, client.num_pages * client.page_size)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, limit - len(ids) + 1)
        return await respond(request, req, ids, max_tokens, chat=True)

    async def respond(request, req, ids, max_tokens, chat):
        """Admit the request into the engine, then answer with one JSON body or a stream of events."""
        refuse_if_unavailable()
        if req.model is not None and req.model != name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found", type="not_found_error")
        prompt = "messages" if chat else "prompt"
        sampling = dict(n=req.n, temperature=req.temperature or 0.0, seed=req.seed)
        try:
            if req.use_beam_search:
                return await beams(req, ids, max_tokens, chat)
            rid, tokens = await client.add(ids, max_tokens, eos_id, **sampling)
        except PositionLimitError as e:
            raise APIError(400, f"{e}; shorten the {prompt} or max_tokens", param=prompt,
                           code="context_length_exceeded") from None
        except OutOfPagesError as e:
            raise APIError(400, f"{e}; it could never be served", param=prompt, code="exceeds_kv_pool") from None
        except InputError as e:
            raise APIError(400, str(e), param=prompt) from None
        reply = Reply(tok, name, chat, ids, req.return_token_ids, req.n)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(stream(rid, req.n, tokens, reply, usage), media_type="text/event-stream")
        answered = asyncio.ensure_future(collect(tokens, reply))
        left = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({answered, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            gone = not answered.done()               # the client left (or the handler was cancelled)
            if gone:
                answered.cancel()                    # (a request to cancel: the task ends later)
                client.cancel(rid, req.n)            # free its pages: nobody waits for its tokens
        if gone:
            return Response(status_code=499)         # nginx's "client closed request": nobody reads it
        answered.result()                            # EngineFailed: 500
        return reply.body()

    async def beams(req, ids, max_tokens, chat):
        """Beam search with n beams: the n best hypotheses as the choices, best first, once the search ends."""
        sequences, _ = await client.beam(ids, max_tokens, eos_id, num_beams=req.n, length_penalty=req.length_penalty,
                                         early_stopping=req.early_stopping)
        reply = Reply(tok, name, chat, ids, req.return_token_ids, len(sequences))
        for i, seq in enumerate(sequences):
            for j, token in enumerate(seq):
                last = j == len(seq) - 1
                reply.add(token, None if not last else "stop" if token == eos_id else "length", i)
        return reply.body()

    async def stream(rid, n, tokens, reply, usage):
        """Server-sent events: one chunk per token of any choice (its index in it), each choice's last with its
        finish_reason, then [DONE]; an error event, then [DONE], if the engine fails meanwhile."""
        done = False
        try:
            try:
                while not done:
                    done = reply.add(*await next_token(tokens))
                    yield f"data: {json.dumps(reply.chunk())}\n\n"
                if usage:
                    yield f"data: {json.dumps(reply.chunk(usage=True))}\n\n"
            except EngineFailed as e:
                done = True                                  # the engine has dropped it already
                yield f"data: {json.dumps({'error': server_error(e).body})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:                                     # the client went away: free the pages
                client.cancel(rid, n)

    return app


async def next_token(tokens: asyncio.Queue) -> tuple:
    item = await tokens.get()
    if isinstance(item, Exception):                          # the engine failed
        raise item
    return item


async def collect(tokens: asyncio.Queue, reply: "Reply"):
    """Every token of a reply that is not streamed."""
    while not reply.add(*await next_token(tokens)):
        pass


async def disconnected(request: Request):
    """Returns once the client has gone away (its body was read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """One request's answer as it grows: its n choices' tokens, their text, the OpenAI objects carrying them."""

    def __init__(self, tokenizer, model: str, chat: bool, prompt_ids, with_ids: bool, n: int = 1):
        self.model, self.chat, self.prompt_ids, self.with_ids = model, chat, prompt_ids, with_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [Choice(IncrementalDetokenizer(tokenizer)) for _ in range(n)]
        self.last = self.choices[0]                        # the choice the last add went to

    def add(self, token: int, finish: str | None, index: int = 0) -> bool:
        """Take the next token of choice `index`; True once every choice has its last. The eos token is not
        part of the text, and a piece that ends inside a multi-byte character waits for the next token."""
        c = self.last = self.choices[index]
        c.ids.append(token)
        c.new, c.finish = [token], finish
        c.piece = "" if finish == "stop" else c.detokenizer.add([token])
        if finish is not None:
            c.piece += c.detokenizer.flush()
        c.text += c.piece
        return all(c.finish is not None for c in self.choices)

    def usage(self) -> dict:
        """The prompt counted once, every choice's tokens."""
        n, m = len(self.prompt_ids), sum(len(c.ids) for c in self.choices)
        return dict(prompt_tokens=n, completion_tokens=m, total_tokens=n + m)

    def _choice(self, c, text, ids, stream) -> dict:
        first = not (stream and c.ids[:-1])                # the first chunk of a choice, or the whole answer
        index = self.choices.index(c)
        if self.chat:
            key = "delta" if stream else "message"
            message = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, key: message, "logprobs": None, "finish_reason": c.finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish}
        if self.with_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = list(self.prompt_ids)
        return choice

    def chunk(self, usage=False) -> dict:
        """The streamed chunk for the last token (or, with usage=True, the closing usage chunk)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = dict(id=self.id, object=kind, created=self.created, model=self.model)
        if usage:
            return out | dict(choices=[], usage=self.usage())
        return out | dict(choices=[self._choice(self.last, self.last.piece, self.last.new, stream=True)])

    def body(self) -> dict:
        """The whole answer, not streamed."""
        kind = "chat.completion" if self.chat else "text_completion"
        return dict(id=self.id, object=kind, created=self.created, model=self.model,
                    choices=[self._choice(c, c.text, list(c.ids), stream=False) for c in self.choices],
                    usage=self.usage())


class Choice:
    """One choice of a reply: its tokens, the text shown of them, what the last token brought."""

    def __init__(self, detokenizer):
        self.detokenizer, self.ids, self.text = detokenizer, [], ""
        self.new, self.piece, self.finish = [], "", None
