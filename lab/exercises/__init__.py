"""Reader exercises: each chapter's checks, which run a reader's function against an independent oracle.

A check raises AssertionError with a hint when the answer is wrong and prints a line when it is right.
A check also enforces the exercise's rule: where an exercise forbids a shortcut the library offers, the
shortcut raises while the reader's function runs, however it is reached (`rules.py`), and the reader's
function may not change the check or its oracle. Where an answer could be looked up, the cases are drawn
fresh at every run (the seed is printed; `seed=` draws them again) and the oracle runs only after the
reader's function has answered. Reference solutions live in
`chNN_solutions.py`; the tests run every check on them and on at least one forbidden shortcut, so an
exercise can never silently rot or pass trivially.

Open-ended exercises ask the reader to measure something on their own machine; `compare_with_book` sets
that number beside the book's own measurement from the committed results/results.json.
"""

from ..results import COMMITTED, format_value, lookup, read


def compare_with_book(key: str, measured: float, unit: str | None = None, path=COMMITTED) -> float:
    """Print the reader's `measured` value beside the book's value at results key `key`; return their ratio.

    The book's value comes from the committed results file (a full run, with the machine it ran on), never
    from the reader's own quick-mode file. unit defaults to the book value's unit.
    """
    doc = read(path)
    leaf = lookup(doc, key, source=str(path))
    book = leaf["value"]
    if not isinstance(book, (int, float)) or isinstance(book, bool):
        raise ValueError(f"{key} holds {book!r}, not a number to compare with")
    machine = doc["sections"][key.split(".")[0]]["provenance"]["machine"]
    mine = format_value({"value": measured, "unit": unit or leaf.get("unit")}, ".3g")
    ratio = measured / book if book else float("inf")
    print(f"yours: {mine}; the book's: {format_value(leaf, '.3g')} on {machine['processor']} "
          f"({machine['cpu_count']} CPUs, {machine['torch_threads']} threads): ratio {ratio:.2f}")
    return ratio
