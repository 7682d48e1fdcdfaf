"""The errors every cache raises: each names what was wrong and what was expected."""


class CacheError(Exception):
    """Base class of every cache error."""


class CacheFullError(CacheError):
    """More positions than a fixed-capacity cache holds."""


class OutOfPagesError(CacheFullError):
    """The pool has fewer free pages than an operation needs; nothing was changed."""


class CacheInputError(CacheError, ValueError):
    """Keys or values of the wrong rank, shape, dtype or device, or a layer index out of range."""


class CacheStateError(CacheError):
    """An operation that the cache's state does not allow: uneven layers, a bad advance or crop."""


class CacheMismatchError(CacheError):
    """A cache used with a model it was not built for."""
