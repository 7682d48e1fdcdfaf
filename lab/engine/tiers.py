"""Tiers below the pool (chapter 11, section 1): pages evicted from a prefix cache's pool go to host memory, then
to disk, and come back by name instead of being computed. A page file that does not load or match is refused,
deleted and recomputed; each writer writes under a temporary name of its own, so processes sharing a folder never
replace each other's half-written file.
"""

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from ..cache import CacheInputError

REFUSED = object()          # what Tiers._load returns for a page file it will not serve
DIGEST_BYTES = 32           # chapter 6's page names are sha256 digests


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, in memory order (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 of the raw bytes of a page's keys and values."""
    return hashlib.sha256(raw(k) + raw(v)).hexdigest()


class Tiers:
    """Pages by name below a pool: `host_pages` in host memory, then any number as files in `disk_dir`.
    put(key, page) keeps a page evicted from the pool (page: (k, v), each `[layers, page_size, H_kv, D]`, or None
    for a dry run); take(key) removes and returns (page, tier) for a name it holds, or None. key: (digest, parent
    digest, tokens), as BlockManager names pages."""

    def __init__(self, host_pages: int = 0, disk_dir=None):
        if isinstance(host_pages, bool) or not isinstance(host_pages, int) or host_pages < 0:
            raise CacheInputError(f"host_pages must be an int of at least 0, got {host_pages!r}")
        self.host_pages = host_pages
        self.host = OrderedDict()                 # digest -> (key, page), least recently stored first
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.disk = {}                            # digest -> (key or None, path or None); None key: found on disk
        self.dropped = self.corrupt = 0           # pages no tier could keep; page files refused
        self.write_failed = 0                     # pages dropped because their file could not be written
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            for path in self.disk_dir.glob("*.page"):             # a warm restart: the files are the index
                with contextlib.suppress(ValueError):             # not hex: README.page, say
                    if len(digest := bytes.fromhex(path.stem)) == DIGEST_BYTES and path.is_file():
                        self.disk[digest] = (None, path)

    def __contains__(self, key) -> bool:
        return key[0] in self.host or key[0] in self.disk

    def put(self, key, page):
        """Keep an evicted page: in host memory while it has room, the oldest host page moving to disk."""
        if self.host_pages:
            self.host[key[0]] = (key, page)
            if len(self.host) <= self.host_pages:
                return
            key, page = self.host.popitem(last=False)[1]            # the least recently stored
        self._to_disk(key, page)

    def _to_disk(self, key, page):
        if self.disk_dir is None:
            self.dropped += 1
            return
        digest, parent, tokens = key
        path = None
        if page is not None:                                        # a dry run keeps names only
            k, v = page
            path = self.disk_dir / f"{digest.hex()}.page"
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")   # this writer's own
            try:
                torch.save(dict(digest=digest, parent=parent, tokens=list(tokens), k=k, v=v,
                                sha256=checksum(k, v)), tmp)
                os.replace(tmp, path)                               # never a half-written page file
            except (OSError, RuntimeError):                         # disk full, folder read-only or gone
                tmp.unlink(missing_ok=True)
                self.dropped += 1
                self.write_failed += 1
                return
        self.disk[digest] = (key, path)

    # region tiers_take
    def take(self, key):
        """(page, "host" | "disk") for a page stored under exactly this name, removed from its tier;
        None for a miss, a name collision (same digest, other parent or tokens) or a refused page
        file."""
        digest, parent, tokens = key
        if digest in self.host:
            stored, page = self.host[digest]
            if (stored[1], tuple(stored[2])) != (parent, tuple(tokens)):
                return None
            del self.host[digest]
            return page, "host"
        if digest not in self.disk:
            return None
        page = self._load(*self.disk.pop(digest), key)   # its name and bytes checked, its file deleted
        return None if page is REFUSED else (page, "disk")
    # endregion

    def _load(self, stored, path, key):
        """The page in `path` if it loads and its name and checksum match `key` and its bytes, else REFUSED (the
        file is deleted either way). A dry run's entry has no file: None when its stored name matches."""
        digest, parent, tokens = key
        if path is None:                                            # a dry run: the name alone
            return None if (stored[1], tuple(stored[2])) == (parent, tuple(tokens)) else REFUSED
        try:
            d = torch.load(path, mmap=True, weights_only=True)
            k, v = d["k"], d["v"]
            ok = (d["digest"], d["parent"], tuple(d["tokens"])) == (digest, parent, tuple(tokens)) and \
                checksum(k, v) == d["sha256"]
            page = (k.clone(), v.clone()) if ok else REFUSED
        except Exception:                                           # truncated, not a page file, unreadable
            page = REFUSED
        with contextlib.suppress(OSError):                          # gone already, or not a file after all
            path.unlink(missing_ok=True)
        self.corrupt += page is REFUSED
        return page

    def stats(self) -> dict:
        return dict(host_held=len(self.host), disk_held=len(self.disk), dropped=self.dropped, corrupt=self.corrupt,
                    write_failed=self.write_failed)
