"""Input and state checks for the caches, kept apart so that a listed cache class shows the idea.

Every check raises a typed CacheError naming what was wrong and what was expected, before anything
changes, so a failed call leaves the cache exactly as it was.
"""
