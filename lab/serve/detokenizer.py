"""Incremental detokenization: a reply's text, token by token, decoding only a short window each time.

Decoding every token at every step costs O(n^2). As vLLM's `detokenize_incrementally`, two offsets into the ids,
`prefix_offset` (a short window of context) and `read_offset` (the ids not yet shown), let a step decode the window
with and without the new ids and show what they added. Text ending in "\ufffd" (half a multi-byte UTF-8 character)
is held back until the character is complete or the reply ends.
"""


class IncrementalDetokenizer:
    """One reply's text as its ids arrive: `add(ids)` returns the text they complete. Everything `add` and `flush`
    return, concatenated, equals `tokenizer.decode(all the ids)` for a tokenizer whose decoding of a sequence
    starts with its decoding of any prefix not ending in "\ufffd" (byte-level BPE; the byte tokenizer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids = []              # every id so far
        self.prefix_offset = 0     # the window of context starts here ...
        self.read_offset = 0       # ... and the ids whose text was not shown yet start here

    def add(self, ids: list[int]) -> str:
        """Take new ids; the text they complete ("" while it ends inside a character)."""
        self.ids += ids
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (the reply ended): shown as it is, "\ufffd" included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""                              # nothing new, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]
