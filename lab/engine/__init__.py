"""The engine: backends that take ids and return scores, state identity, and the generation loop."""

from ..cache.radix import RadixCache
from .backends import CachedBackend, LibraryBackend, RecomputeBackend, as_ids, common_prefix
from .beam import BeamResult, beam_search
from .chat import ChatSession
from .disagg import DecodeEngine, HandoffError, PageSet, PrefillEngine, WorkerError, prefill
from .generate import Generation, generate, greedy_agreement, positions_cached, positions_uncached
from .hashing import block_hashes, root_digest
from .identity import IdentityError, StateIdentity, identity_of, key_for, prefix_key
from .prefix import PrefixCachingBackend
from .serving import EngineStateError, ServingEngine, drive
from .speculative import (
           EarlyExit,
           ModelDraft,
           PromptLookup,
           SelfDraft,
           SpecInputError,
           SpecResult,
           speculative_generate,
)

__all__ = ["CachedBackend", "LibraryBackend", "RecomputeBackend", "as_ids", "Generation", "generate",
           "greedy_agreement", "positions_cached", "positions_uncached", "IdentityError", "StateIdentity",
           "identity_of", "key_for", "prefix_key", "block_hashes", "root_digest", "PrefixCachingBackend",
           "ChatSession", "common_prefix", "ServingEngine", "EngineStateError", "drive", "speculative_generate",
           "SpecResult", "SpecInputError", "PromptLookup", "SelfDraft", "EarlyExit", "ModelDraft", "RadixCache",
           "beam_search", "BeamResult", "PageSet", "HandoffError", "PrefillEngine", "DecodeEngine", "prefill",
           "WorkerError"]
