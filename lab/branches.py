"""Pages held by many answers to one prompt (chapter 12), counted on a BlockManager: bookkeeping only, no model.

Parallel sampling prefills a prompt once and forks its pages into n answers at its first token; an answer
then writes only pages of its own (the shared, partly filled last page copied on its first write), and
gives them back when it ends. Without sharing, each answer is a request of its own with its own copy of the
prompt. `sampling_pages` steps both through the same decode steps and counts the pages held after each,
as the vLLM paper measures its savings (the pages held over a request's life, shared against not).

    lengths = synthetic_lengths("Alpaca", 100)          # lab.data
    sampling_pages(prompt=19, outputs=[58, 40, 71, 12], page_size=16)["saving"]
"""

from .cache import BlockManager
from .cache.block_manager import pages_for


def sampling_pages(prompt: int, outputs: list, page_size: int = 16) -> dict:
    """n = len(outputs) answers to a prompt of `prompt` tokens, answer i generating outputs[i] tokens (>= 1).
    Returns {"shared": page-steps with forks, "independent": page-steps with n requests, "peak_shared",
    "peak_independent", "saving": 1 - shared / independent, "copies": pages copied on write}; a page-step is
    a page held after one step, summed over the steps from the prefill to the last answer's end."""
    n, longest = len(outputs), max(outputs)
    if prompt < 1 or n < 1 or min(outputs) < 1:
        raise ValueError(f"a prompt of at least 1 token and answers of at least 1, got {prompt}, {outputs}")
    size = n * pages_for(prompt + longest, page_size) + 1
    shared, apart = BlockManager(size, page_size), BlockManager(size, page_size)
    shared.reserve(0, prompt)                                   # one prefill, then the answers fork it
    for i in range(1, n):
        shared.fork(0, i)
    for i in range(n):
        apart.reserve(i, prompt)                                # a prefill each
    held = {"shared": [], "independent": []}
    copies = 0
    for step in range(longest):                                 # step t: every answer has t + 1 tokens
        for bm, name in ((shared, "shared"), (apart, "independent")):
            for i, out in enumerate(outputs):
                if step == out:                                 # its last token came at the step before
                    bm.release(i)
                elif step and step < out:                       # the previous token's keys and values
                    done = bm.reserve(i, 1)
                    copies += len(done) if bm is shared else 0
            held[name].append(bm.num_pages - bm.num_free)
    total = {name: sum(h) for name, h in held.items()}
    return dict(total, peak_shared=max(held["shared"]), peak_independent=max(held["independent"]),
                saving=1 - total["shared"] / total["independent"], copies=copies)
