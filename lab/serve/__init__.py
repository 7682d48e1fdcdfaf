"""`python -m lab.serve`: an OpenAI-compatible HTTP server over the ServingEngine (chapter 8).

    python -m lab.serve --model smollm2 --port 8000
    python -m lab.serve --workers 2 --router kv_aware      # two engines behind a cache-aware router
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'

The engine steps in a process of its own (engine_loop.py), as vLLM runs its engine core; app.py speaks OpenAI's
API (api.py) with vLLM's `use_beam_search` and `return_token_ids`; fleet.py routes over several engines.
"""

from .api import MAX_BODY_BYTES, APIError
from .app import create_app
from .client import EngineClient, EngineFailed, RequestIdError
from .detokenizer import IncrementalDetokenizer
from .engine_loop import EngineLoop, EngineProcess, EngineThread
from .fleet import Fleet

__all__ = ["create_app", "APIError", "MAX_BODY_BYTES", "EngineLoop", "EngineThread", "EngineProcess",
           "EngineClient", "Fleet", "EngineFailed", "RequestIdError", "IncrementalDetokenizer"]
