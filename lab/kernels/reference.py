"""Paged decode attention in plain PyTorch: the readable reference the Triton kernel is tested against.

One decode step: every sequence in the batch has one new query per head, and its keys and values live
in pages of a shared pool. The sequence's block table lists its pages in order, so position t sits in
page `block_table[t // page_size]` at offset `t % page_size`. For each sequence the reference gathers
the key pages into one contiguous `[L, H_kv, D]` tensor, keeps the first `length` positions (the tail of
the last page and the block table's padding are never looked at), takes a float32 softmax, and sums the
values it needs straight from the pool by index.

`check_paged_inputs` holds the argument checks that the reference and the Triton kernel share.
"""

import math

import torch
import torch.nn.functional as F


def check_paged_inputs(q, k_pool, v_pool, block_tables, lengths) -> None:
    """Raise TypeError or ValueError, naming the argument, for anything the kernels cannot serve.

    Expected: q [batch, q_heads, head_dim], k_pool and v_pool [num_pages, page_size, kv_heads, head_dim]
    of q's dtype, block_tables int32 [batch, max_pages], lengths int32 [batch] with
    1 <= length <= max_pages * page_size, every block-table entry naming a page of the pool, all on one
    device. Reads the extremes of `lengths` and `block_tables` on the host (a synchronisation on a GPU).
    """
    named = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "block_tables": block_tables, "lengths": lengths}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, rank, layout in [("q", q, 3, "[batch, q_heads, head_dim]"),
                                  ("k_pool", k_pool, 4, "[num_pages, page_size, kv_heads, head_dim]"),
                                  ("v_pool", v_pool, 4, "[num_pages, page_size, kv_heads, head_dim]"),
                                  ("block_tables", block_tables, 2, "[batch, max_pages]"),
                                  ("lengths", lengths, 1, "[batch]")]:
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all inputs must be on one device, got {where}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {pool.dtype}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must have k_pool's shape {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    batch, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, pool_head_dim = k_pool.shape
    if batch == 0:
        raise ValueError("q has batch 0; a decode step needs at least one sequence")
    if num_pages == 0 or page_size == 0 or kv_heads == 0:
        raise ValueError(f"k_pool must have at least one page, position and kv head, got shape {tuple(k_pool.shape)}")
    if pool_head_dim != head_dim:
        raise ValueError(f"k_pool head_dim {pool_head_dim} (shape {tuple(k_pool.shape)}) must equal q's head_dim "
                         f"{head_dim} (shape {tuple(q.shape)})")
    if q_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q_heads {q_heads} (q shape {tuple(q.shape)}) must be a positive multiple of kv_heads "
                         f"{kv_heads} (k_pool shape {tuple(k_pool.shape)}) for grouped-query attention")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, max_pages], got shape {tuple(block_tables.shape)}")
    if lengths.dtype != torch.int32:
        raise TypeError(f"lengths must be int32, got {lengths.dtype}")
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths must be [batch={batch}], got shape {tuple(lengths.shape)}")
    capacity = block_tables.shape[1] * page_size
    shortest, longest = (int(x) for x in torch.aminmax(lengths))
    if shortest < 1:
        raise ValueError(f"every length must be at least 1 (a decode query sees itself), "
                         f"got lengths {lengths.tolist()}")
    if longest > capacity:
        raise ValueError(f"a length of {longest} exceeds what block_tables can address: max_pages "
                         f"{block_tables.shape[1]} * page_size {page_size} = {capacity}")
    # Every entry, padding included, must name a page of the pool (the padding is 0 by contract): a
    # bad id would make the Triton kernel read outside the pool instead of failing.
    lowest, highest = (int(x) for x in torch.aminmax(block_tables))
    if lowest < 0 or highest >= num_pages:
        raise ValueError(f"block_tables holds page ids from {lowest} to {highest}, but the pool has {num_pages} "
                         f"pages (ids 0 to {num_pages - 1}); pad block tables with 0")


def paged_attention_reference(q, k_pool, v_pool, block_tables, lengths, scale=None):
    """Decode attention over paged keys and values, by gathering the pages. Returns [B, H_q, D] in q's dtype.

    q [B, H_q, D]; k_pool, v_pool [num_pages, page_size, H_kv, D]; block_tables int32 [B, max_pages]
    (entries past a sequence's pages are ignored); lengths int32 [B] (positions per sequence, this one
    included). Query head h reads kv head h // (H_q // H_kv). Scores and softmax are computed in float32;
    the weighted sum of values runs in the pools' dtype (the probabilities are cast to it).

    One sequence at a time, in two halves. Keys: gather the sequence's pages into one buffer and take the
    scores with a matrix product. Values: `embedding_bag` looks rows up by index and adds them, weighted by
    the probabilities, without copying them out first: gather and sum fused, as the Triton kernel does for
    both halves. Gathering the values as well and multiplying measured slower on two CPU threads (one more
    copy, and a batched product of 3-row matrices that uses the cores poorly); gathering the whole batch
    at once, padded and masked, slower still. The chapter's table compares this with a contiguous cache.
    """
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    group = H_q // H_kv                                               # query heads per kv head
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    # Grouped-query attention without repeating k and v: the query heads that share kv head j are
    # q[:, j * group : (j + 1) * group], so q viewed as [B, H_kv, group, D] lines them up with kv head j.
    q_grouped = q.reshape(B, H_kv, group, D).float() * scale         # [B, H_kv, group, D], pre-scaled
    # Like the Triton kernel, hand the matrix product a power-of-two number of query rows, padding with
    # zero rows whose scores are dropped. BLAS kernels work on rows in blocks, and on the CPU that ran
    # this book's results a 3-row product measured slower than a 4-row one.
    padded = 1 << (group - 1).bit_length()                            # group rounded up to a power of two
    q_grouped = F.pad(q_grouped, (0, 0, 0, padded - group))           # [B, H_kv, padded, D]
    # The value pool as a table of rows, one per (slot, kv head): row (page * page_size + offset) * H_kv + j.
    # A view of a contiguous pool (a PagedCache's are); any other pool is copied once here.
    v_rows = v_pool.reshape(-1, D)                                    # [num_pages * page_size * H_kv, D]
    offset = torch.arange(page_size, device=q.device)                 # [page_size]
    kv_head = torch.arange(H_kv, device=q.device)[:, None, None]      # [H_kv, 1, 1]
    bag_starts = torch.arange(H_q, device=q.device)                   # [H_q]: one bag per query head
    out = torch.empty(B, H_q, D, dtype=q.dtype, device=q.device)      # [B, H_q, D]
    for b, length in enumerate(lengths.tolist()):
        pages = block_tables[b, : -(-length // page_size)]           # [n_pages]: ceil(length / page_size)
        # index_select copies whole pages (page_size * H_kv * D contiguous values each; faster than fancy
        # indexing or a per-position slot index); the view lays them end to end, so row t is position t,
        # and the slice drops the unused tail of the last page.
        k = k_pool.index_select(0, pages).view(-1, H_kv, D)[:length]  # [length, H_kv, D]
        # The permute is a view: matmul reads k in its gathered layout, with no transposed copy.
        scores = q_grouped[b] @ k.permute(1, 2, 0).float()            # [H_kv, padded, D] @ [H_kv, D, length]
        scores = scores[:, :group]                                    # -> [H_kv, group, length]
        probs = scores.softmax(dim=-1)                                # [H_kv, group, length], float32
        # Position t's slot is pages[t // page_size] * page_size + t % page_size; its value for kv head j
        # is row slot * H_kv + j. Query head (j, g) sums those rows weighted by probs[j, g].
        slots = (pages.long()[:, None] * page_size + offset).view(-1)[:length]  # [length]
        row_ids = (slots * H_kv + kv_head).expand(H_kv, group, length)         # [H_kv, group, length]
        out[b] = F.embedding_bag(row_ids.reshape(-1), v_rows, bag_starts * length, mode="sum",
                                 per_sample_weights=probs.reshape(-1).to(v_pool.dtype))  # [H_q, D]
    return out                                                        # [B, H_q, D]
