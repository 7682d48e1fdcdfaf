"""Argument checks of the paged-attention kernels, kept apart so a listed kernel shows the idea."""

import torch


def check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, values=True, window=0, sinks=0) -> None:
    """Raise TypeError or ValueError, naming the argument, for anything the kernels cannot serve: q
    [batch, q_heads, head_dim], k_pool and v_pool [num_pages, page_size, kv_heads, head_dim] of q's
    dtype, block_tables int32 [batch, max_pages], lengths int32 [batch], all on one device; window
    and sinks ints >= 0, sinks only with a window. With `values` (a synchronisation on a GPU), also
    1 <= length <= max_pages * page_size and every block-table entry naming a page of the pool."""
    for name, n in (("window", window), ("sinks", sinks)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if sinks and not window:
        raise ValueError(f"sinks ({sinks}) need a window: with window 0 every position is read")
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
    if len({t.device for t in named.values()}) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in named.items())
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
    for name, t, layout in (("block_tables", block_tables, f"[batch={batch}, max_pages]"),
                            ("lengths", lengths, f"[batch={batch}]")):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.shape[0] != batch:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if not values:
        return
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


def check_cascade_inputs(q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths, values=True) -> None:
    """`check_paged_inputs` for a cascade (cascade.py), and besides: shared_table int32 [S] on q's
    device, shared_length an int with ceil(shared_length / page_size) == S (0 and an empty table: no
    shared part); with `values`, shared_table's page ids. Each branch's own length is at least 1."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, values)
    if not isinstance(shared_table, torch.Tensor):
        raise TypeError(f"shared_table must be a torch.Tensor, got {type(shared_table).__name__}")
    if shared_table.dtype != torch.int32:
        raise TypeError(f"shared_table must be int32, got {shared_table.dtype}")
    if shared_table.dim() != 1:
        raise ValueError(f"shared_table must have rank 1 [shared_pages], got shape {tuple(shared_table.shape)}")
    if shared_table.device != q.device:
        raise ValueError(f"shared_table must be on q's device {q.device}, got {shared_table.device}")
    if isinstance(shared_length, bool) or not isinstance(shared_length, int):
        raise TypeError(f"shared_length must be an int, got {type(shared_length).__name__}")
    num_pages, page_size = k_pool.shape[:2]
    if shared_length < 0 or -(-shared_length // page_size) != len(shared_table):
        raise ValueError(f"shared_length {shared_length} must be >= 0 and fill the {len(shared_table)} pages of "
                         f"shared_table, the last one at least in part (page_size {page_size})")
    if values and len(shared_table):
        lowest, highest = (int(x) for x in torch.aminmax(shared_table))
        if lowest < 0 or highest >= num_pages:
            raise ValueError(f"shared_table holds page ids from {lowest} to {highest}, but the pool has "
                             f"{num_pages} pages (ids 0 to {num_pages - 1})")
