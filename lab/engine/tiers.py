"""Tiers below the pool (chapter 11): pages evicted from a prefix cache's pool are kept, not forgotten.

A full page's keys and values are named by chapter 6's chained digest, which covers the state identity
(model, dtype, salt) and every token before and in it. That name stays the page's identity in every tier:
the pool, a host tier (a second, larger pool of tensors in host memory) and a disk tier (one file per page in
a folder). When the pool reuses a named page, the page moves to the host tier; when the host tier is full,
its least recently stored page moves to disk; only then, or with no disk tier, is a page dropped. A later
request whose prefix misses in the pool but hits a tier gets the page back, copied into a fresh pool page,
instead of computing it. A page from another model or salt has another name, so it is never restored.

A page file holds the name (digest, parent digest, tokens), the keys and values, and a sha256 of their bytes.
A file that does not load, whose checksum or name does not match, is refused, deleted and recomputed, never
served. Files outlive the process: a new backend on the same folder finds them (a warm restart), and files
that are not page files are left alone. A page that cannot be written (a full disk, a folder that refuses
writes) is dropped and counted (`write_failed`), its partial file removed: the pool above never notices. Each
writer writes under a temporary name of its own, so processes that share a folder never replace each
other's half-written file.

Restores here are synchronous: the copy happens before the forward that needs it, where an engine on a GPU
would overlap the next page's copy with the forward of the current one.
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


def checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 of the raw bytes of a page's keys and values."""
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Tiers:
    """Pages by name below a pool: `host_pages` of them in host memory, then any number as files in `disk_dir`.

    put(key, page) stores a page evicted from the pool (page: (k, v), each `[layers, page_size, H_kv, D]`,
    or None for a dry run's bookkeeping); take(key) removes and returns (page, tier) for a name it holds
    ("host" or "disk"), or None. key = (digest, parent digest, tokens), as BlockManager names pages.
    """

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
                if (digest := _digest(path.stem)) and path.is_file():   # skip README.page and the like
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


def _digest(stem: str) -> bytes | None:
    """The digest a page file's name spells (sha256, 64 hex digits), or None for a name that spells none."""
    try:
        digest = bytes.fromhex(stem)
    except ValueError:
        return None
    return digest if len(digest) == DIGEST_BYTES else None
