"""Reference solutions for chapter 5 (the tests run the checks on these)."""


def speculative_step(cache, accepted, drafted):
    cache.crop(cache.length - drafted + accepted)  # pages past the new end go back to the pool


def best_block_size(total_lengths, candidates, bytes_per_position):
    def waste(b):
        pages = [-(-n // b) for n in total_lengths]
        return sum((p * b - n) * bytes_per_position + 4 * p for p, n in zip(pages, total_lengths, strict=True))

    return min(candidates, key=lambda b: (waste(b), b))
