"""Reference solutions for chapter 12: copy on write by hand, the log-sum-exp merge, beams moved by their block
tables."""

import torch


class Pages:
    """A block table and a length per sequence, a reference count per page. A fork counts its source's pages once
    more; a write into a shared, partly filled last page first takes a copy of it; a page goes back to the pool
    when its count drops to 0."""

    def __init__(self, pool):
        self.pool, self.P = pool, pool.page_size
        self.tables, self.lengths, self.refs = {}, {}, {}

    def take(self) -> int:
        page = self.pool.take()
        self.refs[page] = 1
        return page

    def append(self, seq, value):
        table, n = self.tables.setdefault(seq, []), self.lengths.get(seq, 0)
        if n % self.P == 0:                              # the last page is full (or there is none): a new one
            table.append(self.take())
        elif self.refs[table[-1]] > 1:                   # shared and partly filled: copy it first
            old, table[-1] = table[-1], self.take()
            self.refs[old] -= 1
            self.pool.copy(old, table[-1])
        self.pool.write(table[-1], n % self.P, value)
        self.lengths[seq] = n + 1

    def fork(self, src, dst):
        self.tables[dst], self.lengths[dst] = list(self.tables[src]), self.lengths[src]
        for page in self.tables[dst]:
            self.refs[page] += 1

    def release(self, seq):
        for page in self.tables.pop(seq):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.pool.give(page)
        del self.lengths[seq]

    def block_table(self, seq) -> list:
        return self.tables[seq]


def merge(out_1, lse_1, out_2, lse_2):
    # Each part's softmax denominator is exp(lse_i); the union's is their sum. Weigh each output by its share,
    # with the larger lse subtracted first: the larger weight is exp(0) = 1, so nothing overflows, and an empty
    # part (lse -inf) weighs exp(-inf) = 0.
    m = torch.maximum(lse_1, lse_2)
    w_1, w_2 = torch.exp(lse_1 - m), torch.exp(lse_2 - m)
    out = (w_1[..., None] * out_1 + w_2[..., None] * out_2) / (w_1 + w_2)[..., None]
    return out, m + torch.log(w_1 + w_2)


def reorder(tables, lengths, parents, refs, free, page_size):
    # Every new beam takes its parent's table, each page counted once more; then the old beams let go of theirs
    # (a dropped beam's pages return to `free` when nobody holds them). Then each new beam makes room for its
    # next position: a new page after a full one, or, when its last page is shared, a copy of it.
    new_tables = [list(tables[b]) for b in parents]
    for table in new_tables:
        for page in table:
            refs[page] += 1
    for table in tables:
        for page in table:
            refs[page] -= 1
            if refs[page] == 0:
                free.append(page)
    copies = []
    for table, b in zip(new_tables, parents, strict=True):
        if lengths[b] % page_size == 0:                  # the last page is full: the next position starts a new one
            table.append(free.pop(0))
            refs[table[-1]] = 1
        elif refs[table[-1]] > 1:                        # shared and partly filled: copy it before writing
            old, table[-1] = table[-1], free.pop(0)
            refs[old] -= 1
            refs[table[-1]] = 1
            copies.append((old, table[-1]))
    return new_tables, copies
