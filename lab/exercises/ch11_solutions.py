"""Reference solutions for chapter 11: a radix tree of token ids; a routing policy that keeps a prompt where it is
cached without piling requests on one worker."""


def common(a, b) -> int:
    """How many leading tokens two runs share."""
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


class RadixTree:
    """A node is a dict: the first token of each child's run -> [run, child node]. Only a node where sequences
    branch or one ends exists, so a walk from the root reads each token of a sequence once."""

    def __init__(self):
        self.root = {}

    def insert(self, ids):
        node, ids = self.root, tuple(ids)
        while ids:
            edge = node.get(ids[0])
            if edge is None:                                    # nothing starts here: the rest is one new run
                node[ids[0]] = [ids, {}]
                return
            run, child = edge
            k = common(run, ids)
            if k < len(run):                                    # ids leaves (or ends inside) the run: split it
                edge[:] = [run[:k], {run[k]: [run[k:], child]}]
            node, ids = edge[1], ids[k:]

    def match(self, ids) -> int:
        node, n, ids = self.root, 0, tuple(ids)
        while n < len(ids) and ids[n] in node:
            run, child = node[ids[n]]
            k = common(run, ids[n:])
            n += k
            if k < len(run):                                    # stopped inside the run
                break
            node = child
        return n

    def tree(self, node=None) -> dict:
        node = self.root if node is None else node
        return {run: self.tree(child) for run, child in node.values()}


def capped_affinity(ids, workers) -> int:
    """The worker holding most of the request's tokens, among those not past their share of the requests
    (at most 1.1 x the mean so far, plus one); ties to the one with fewest requests, then the lowest index.

    A prompt stays where its pages are, so the fleet's pools partition the prompts instead of each holding copies
    of all of them (round robin); a popular prompt that would pile up on one worker spills to another, which then
    holds it too. The cap counts requests, not load: the load window holds only the last few."""
    mean = sum(w.calls for w in workers) / len(workers)
    allowed = [i for i, w in enumerate(workers) if w.calls <= 1.1 * mean + 1]
    return max(allowed, key=lambda i: (workers[i].cached, -workers[i].calls, -i))
