"""ChatSession: a conversation held on one backend, the chat template applied to every turn. A template may render
earlier turns differently once a later one exists, so a cache can reuse of a turn's prompt its longest common
prefix with the sequence the backend saw last (chapter 6): each turn records both, and how much was reused.
"""

import torch

from .backends import common_prefix
from .generate import check_count


class ChatSession:
    """say(text) -> the model's greedy reply; `turns` holds, per turn, prompt_tokens, common_prefix (with the
    previous prompt and reply) and reused_tokens (prompt positions the backend did not compute)."""

    def __init__(self, model, backend, system: str | None = None, max_new_tokens: int = 32):
        check_count("max_new_tokens", max_new_tokens)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__} {system!r}")
        self.model, self.backend, self.max_new_tokens = model, backend, max_new_tokens
        self.messages = [{"role": "system", "content": system}] if system else []
        self.turns, self.seen = [], []           # seen: the ids of the last prompt and its reply

    def computed(self) -> int:
        """Positions the backend has run through the model so far."""
        stats = getattr(self.backend, "stats", None)
        return stats["computed_tokens"] if stats else self.backend.positions

    @torch.inference_mode()
    def say(self, text: str) -> str:
        if not isinstance(text, str):
            raise TypeError(f"say() takes the user's message as a string, got {type(text).__name__} {text!r}")
        tok = self.model.tokenizer
        self.messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(self.messages, add_generation_prompt=True))
        stop = set(tok.encode(tok.special["eos_token"])) if getattr(tok, "special", None) else set()
        before = self.computed()
        reply = [int(self.backend.next_logits(ids).argmax())]   # the prompt: reuse is measured on this call
        reused = len(ids) - (self.computed() - before)
        while reply[-1] not in stop and len(reply) < self.max_new_tokens:
            reply.append(int(self.backend.next_logits(ids + reply).argmax()))
        self.turns.append(dict(prompt_tokens=len(ids), common_prefix=common_prefix(ids, self.seen),
                               reused_tokens=reused, reply_tokens=len(reply)))
        self.seen = ids + reply
        answer = tok.decode([t for t in reply if t not in stop])
        self.messages.append({"role": "assistant", "content": answer})
        return answer
