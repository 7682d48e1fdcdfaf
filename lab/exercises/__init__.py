"""Reader exercises: each chapter's checks, which run a reader's function against an independent oracle.

A check raises AssertionError with a hint when the answer is wrong and prints a line when it is right.
Reference solutions live in `chNN_solutions.py`; the tests run every check on them, and on a wrong
answer, so an exercise can never silently rot.
"""
