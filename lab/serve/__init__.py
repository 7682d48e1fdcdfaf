"""`python -m lab.serve`: an OpenAI-compatible HTTP server over the ServingEngine (chapter 8).

    python -m lab.serve --model smollm2 --port 8000
    python -m lab.serve --workers 2 --router kv_aware      # two engines behind a cache-aware router
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'

- api.py: OpenAI's request and error shapes, reading and checking a body.
- app.py: the HTTP app (FastAPI): the endpoints, OpenAI's response shapes, streaming.
- engine_loop.py: the one loop that steps the engine, run on a thread (EngineThread) or in a process of
  its own (EngineProcess, the default of `python -m lab.serve`, as vLLM runs its engine core).
- client.py: the server's side of the engine (EngineClient): request id -> the stream its tokens go to.
- fleet.py: several engine processes behind one router (`--workers N --router kv_aware`, chapter 11):
  round robin, least loaded, or NVIDIA Dynamo's KV-aware cost over the pages each engine reports named.
- detokenizer.py: a reply's text, token by token, in time linear in its length.
- cli.py: the command line and the signals. If the engine's process dies, the requests in flight fail,
  /health answers 503 and the server exits with code 1 for its supervisor to restart it (cli.py says why).

Decoding is greedy at temperature 0 (or absent), sampled above it (`seed` makes it repeatable); `n` asks for
n choices, which share the prompt's prefill and pages; `use_beam_search: true` (vLLM's extension) runs beam
search with n beams in the engine's loop and answers with the n best hypotheses. `return_token_ids: true`
adds the token ids to each choice (`prompt_token_ids`, `token_ids`), as vLLM does.
"""

from .api import MAX_BODY_BYTES, APIError
from .app import create_app
from .client import EngineClient, EngineFailed, RequestIdError
from .detokenizer import IncrementalDetokenizer
from .engine_loop import EngineLoop, EngineProcess, EngineThread
from .fleet import Fleet

__all__ = ["create_app", "APIError", "MAX_BODY_BYTES", "EngineLoop", "EngineThread", "EngineProcess",
           "EngineClient", "Fleet", "EngineFailed", "RequestIdError", "IncrementalDetokenizer"]
