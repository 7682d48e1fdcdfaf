"""Tokenizers: text to ids and back, with a hash that identifies exactly how text became ids."""

import hashlib
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    """A Hugging Face `tokenizers` BPE tokenizer with the model's chat template."""

    def __init__(self, tok, chat_template=None, special=None):
        self.tok, self.chat_template, self.special = tok, chat_template, special or {}
        self.vocab_size = tok.get_vocab_size()
        blob = tok.to_str() + "\0" + (chat_template or "")
        self.sha256 = hashlib.sha256(blob.encode()).hexdigest()  # vocabulary, merges, rules and template

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt=True) -> str:
        """Render a conversation with the model's own template (Jinja, sandboxed, as transformers does)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        folder = Path(folder)
        if (folder / "tokenizer.json").exists():
            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        elif (folder / "vocab.json").exists() and (folder / "merges.txt").exists():  # older GPT-2 snapshots
            tok = HFTokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        else:
            raise FileNotFoundError(f"no tokenizer.json (or vocab.json and merges.txt) in {folder}")
        template, special = None, {}
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        if (folder / "tokenizer_config.json").exists():
            tc = json.loads((folder / "tokenizer_config.json").read_text())
            template = template or tc.get("chat_template")
            special = {k: tc[k] for k in ("bos_token", "eos_token") if isinstance(tc.get(k), str)}
        return cls(tok, template, special)


class ByteTokenizer:
    """Ids are the UTF-8 bytes of the text: a tokenizer for the random-weight models, which read nothing."""

    vocab_size = 256
    chat_template = None
    sha256 = hashlib.sha256(b"lab.ByteTokenizer v1").hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        raise ValueError("this tokenizer has no chat template (random-weight models have none)")
