"""Tiers below a prefix cache's pool (lab/engine/tiers.py): evicted pages kept in host memory and on disk,
restored on a hit.

Oracle: the plain forward over the whole prompt (recomputation without a cache); a restored page must give the
scores it would, to float32 rounding (1e-5 on logits of order 1, as tests/test_prefix_caching.py). Hits are
proven real by the positions the model did not run (computed_tokens) and the pages the tiers gave back.
"""

import errno
import gc
import random
import threading
import weakref
from pathlib import Path

import pytest
import torch

from lab.cache import CacheInputError
from lab.engine import PrefixCachingBackend
from lab.models import forward, load, random_model

ATOL = 1e-5
P = 4                                               # positions per page: small pools evict often


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def prompt(seed, n=33):
    rng = random.Random(seed)
    return [rng.randrange(320) for _ in range(n)]


def recomputed(model, ids):
    with torch.inference_mode():
        return forward(torch.tensor([ids]), model.weights, model.config)[0, -1]


def serve(backend, model, prompts):
    """Every prompt through the backend, each score checked against recomputation; the pool's invariants
    after each call, and every pool page free again (the backend holds none between calls)."""
    for ids in prompts:
        got = backend.next_logits(ids)
        assert (got - recomputed(model, ids)).abs().max() <= ATOL
        manager = backend.pool.manager
        manager.check()
        assert manager.num_free == manager.num_pages


@pytest.mark.parametrize("host,disk", [(8, False), (2, True), (0, True)])
def test_restored_pages_score_like_recomputation_and_save_the_positions(tiny, tmp_path, host, disk):
    """A, B and C do not fit the pool together (10 pages, 8 full pages each): A and B come back from the tiers."""
    A, B, C = prompt(1), prompt(2), prompt(3)
    plain = PrefixCachingBackend(tiny, num_pages=10, page_size=P)
    tiered = PrefixCachingBackend(tiny, num_pages=10, page_size=P, host_pages=host,
                                  disk_dir=tmp_path if disk else None)
    serve(plain, tiny, [A, B, C, A, B])
    serve(tiered, tiny, [A, B, C, A, B])
    restored = tiered.stats["host_hits"] + tiered.stats["disk_hits"]
    assert restored > 0 and plain.stats["cached_tokens"] == 0
    assert tiered.stats["computed_tokens"] == plain.stats["computed_tokens"] - P * restored
    assert (tiered.stats["disk_hits"] > 0) == disk


def test_no_page_is_dropped_while_a_tier_has_room(tiny, tmp_path):
    backend = PrefixCachingBackend(tiny, num_pages=10, page_size=P, host_pages=2, disk_dir=tmp_path)
    serve(backend, tiny, [prompt(s) for s in range(6)])
    t = backend.tiers.stats()
    assert t["dropped"] == 0 and t["disk_held"] == len(list(tmp_path.glob("*.page"))) > 0


def test_a_restarted_backend_serves_hits_from_a_warm_disk_tier(tiny, tmp_path):
    """The files outlive the backend: a new one on the same folder runs only the prompt's last token."""
    A = prompt(7)
    first = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    serve(first, tiny, [A, prompt(8), prompt(9)])                # A's pages evicted to disk
    again = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    serve(again, tiny, [A])
    assert again.stats["disk_hits"] == (len(A) - 1) // P and again.stats["computed_tokens"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_page_file_is_refused_and_recomputed(tiny, tmp_path, damage):
    A = prompt(11)
    serve(PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path), tiny, [A, prompt(12), prompt(13)])
    files = sorted(tmp_path.glob("*.page"))
    for path in files:                                           # damage every file: whichever A needs first
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-200] ^= 0xFF                                   # inside the tensors' bytes or the zip's records
        path.write_bytes(bytes(data[: len(data) // 2]) if damage == "truncate" else
                         b"not a page" if damage == "garbage" else bytes(data))
    again = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    serve(again, tiny, [A])                                      # the right scores all the same
    assert again.tiers.corrupt >= 1 and again.stats["disk_hits"] == 0
    assert again.stats["computed_tokens"] == len(A)


def test_another_salt_or_model_never_restores_a_page(tiny, tmp_path):
    A = prompt(21)
    backend = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    for salt in ("tenant-a", "tenant-a", "tenant-b"):            # the second hits (pool), the third must not
        backend.next_logits(A, salt=salt)
        backend.next_logits(prompt(22), salt=salt)
        backend.next_logits(prompt(23), salt=salt)               # A's pages evicted to disk under its salt
    b = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    b.next_logits(A, salt="tenant-c")
    assert b.stats["disk_hits"] == 0 and b.stats["computed_tokens"] == len(A)
    other = random_model(tiny.config, seed=5)                    # same shape, other weights: other names
    o = PrefixCachingBackend(other, num_pages=10, page_size=P, disk_dir=tmp_path)
    serve(o, other, [A])
    assert o.stats["disk_hits"] == 0 and o.stats["computed_tokens"] == len(A)


def test_a_dry_run_counts_what_a_real_run_does(tiny, tmp_path):
    """The tiers' bookkeeping without tensors (dry_run) gives the real run's hits and computed positions."""
    trace = [prompt(s % 3, 21 + 4 * (s % 2)) for s in range(14)]
    real = PrefixCachingBackend(tiny, num_pages=12, page_size=P, host_pages=4, disk_dir=tmp_path / "real")
    dry = PrefixCachingBackend(tiny, num_pages=12, page_size=P, host_pages=4, disk_dir=tmp_path / "dry")
    serve(real, tiny, trace)
    for ids in trace:
        dry.dry_run(ids)
    assert dry.stats == real.stats and real.stats["host_hits"] > 0 and real.stats["disk_hits"] > 0
    assert not list((tmp_path / "dry").glob("*.page"))           # a dry run writes no page files


def test_random_requests_keep_every_tier_consistent(tiny, tmp_path):
    rng = random.Random(3)
    backend = PrefixCachingBackend(tiny, num_pages=14, page_size=P, host_pages=4, disk_dir=tmp_path)
    trace = [prompt(rng.randrange(6), rng.randrange(5, 40)) + prompt(100 + i, rng.randrange(0, 6)) for i in range(25)]
    serve(backend, tiny, trace)
    t = backend.tiers
    assert len(t.host) <= 4 and t.dropped == 0
    on_disk = {p.stem for p in tmp_path.glob("*.page")}
    assert on_disk == {d.hex() for d, (_, path) in t.disk.items() if path is not None}   # no leaked page file


def test_bad_tier_settings_are_refused(tiny):
    with pytest.raises(CacheInputError):
        PrefixCachingBackend(tiny, num_pages=10, page_size=P, host_pages=-1)


def test_a_backend_with_tiers_is_freed_without_the_cycle_collector():
    """The pool's eviction hook must not hold its backend: a pool of real pages (gigabytes at full scale) would
    otherwise live until the cycle collector runs, and a sweep of pool sizes runs out of memory."""
    backend = PrefixCachingBackend(load("tiny-llama"), 16, host_pages=4)
    backend.dry_run(list(range(200)))
    pool = weakref.ref(backend.pool)
    gc.disable()
    try:
        del backend
        assert pool() is None
    finally:
        gc.enable()


def _failing_save(real_save, how):
    """torch.save that leaves a partial file and raises, as a full disk does (ENOSPC), or writes nowhere, as a
    folder that has gone does (torch's RuntimeError)."""
    def save(obj, path):
        if how == "gone":
            raise RuntimeError(f"Parent directory {Path(path).parent} does not exist.")
        Path(path).write_bytes(b"half a page")
        raise OSError(errno.ENOSPC, "No space left on device")
    return save


@pytest.mark.parametrize("how", ["full", "gone"])
def test_a_page_that_cannot_be_written_is_dropped_and_serving_goes_on(tiny, tmp_path, monkeypatch, how):
    """A failed write during an eviction must not escape into the request: the page is dropped and counted,
    no partial file stays, every pool page comes back, and later requests (hits included) score right."""
    import lab.engine.tiers as tiers
    monkeypatch.setattr(tiers.torch, "save", _failing_save(torch.save, how))
    backend = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    A = prompt(31)
    serve(backend, tiny, [A, prompt(32), prompt(33), A, prompt(34), A])       # serve checks the pool each time
    t = backend.tiers.stats()
    assert t["write_failed"] > 0 and t["dropped"] == t["write_failed"] and t["disk_held"] == 0
    assert not list(tmp_path.iterdir())                                        # no .tmp, no .page
    assert backend.stats["cached_tokens"] > 0                                  # the pool still serves hits


def test_two_writers_sharing_a_folder_never_replace_each_others_temporary_file(tmp_path, monkeypatch):
    """Two tiers (two servers) on one folder write the same page at once: the second writes and renames while
    the first is between its write and its rename. Both succeed, and the file holds the page."""
    import lab.engine.tiers as tiers
    real_save = torch.save
    first, second = tiers.Tiers(disk_dir=tmp_path), tiers.Tiers(disk_dir=tmp_path)
    k, v = torch.randn(2, P, 2, 8), torch.randn(2, P, 2, 8)
    key = (bytes(range(32)), bytes(32), tuple(range(P)))         # digest, parent digest, tokens

    def save_then_let_the_other_write(obj, path):
        real_save(obj, path)
        if threading.current_thread() is threading.main_thread():           # the first writer, mid-write
            other = threading.Thread(target=second.put, args=(key, (k, v)))
            other.start()
            other.join()
    monkeypatch.setattr(tiers.torch, "save", save_then_let_the_other_write)
    first.put(key, (k, v))
    assert first.write_failed == second.write_failed == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key[0].hex()}.page"]
    page, tier = tiers.Tiers(disk_dir=tmp_path).take(key)
    assert tier == "disk" and torch.equal(page[0], k) and torch.equal(page[1], v)


def test_files_that_are_not_pages_in_the_disk_folder_are_left_alone(tiny, tmp_path):
    """README.page or abc.page in the folder: the constructor skips them, serving works, they stay."""
    (tmp_path / "README.page").write_text("notes")
    (tmp_path / "abc.page").write_text("not hex")
    (tmp_path / "00.page").write_text("hex, but no digest")
    (tmp_path / f"{'ab' * 32}.page").mkdir()                     # a digest's name, but a folder
    backend = PrefixCachingBackend(tiny, num_pages=10, page_size=P, disk_dir=tmp_path)
    serve(backend, tiny, [prompt(41), prompt(42), prompt(43), prompt(41)])
    assert (tmp_path / "README.page").read_text() == "notes" and (tmp_path / "abc.page").exists()
    assert backend.tiers.stats()["disk_held"] == len([p for p in tmp_path.glob("*.page") if p.is_file()]) - 3 > 0
    assert backend.tiers.corrupt == 0
