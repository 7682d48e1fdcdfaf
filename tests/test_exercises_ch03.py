"""Chapter 3 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest


def test_ch03_flop_checks():
    from lab.exercises import ch03
    from lab.exercises import ch03_solutions as sol3

    assert ch03.check_decode_flops(sol3.decode_flops)
    assert ch03.check_attention_share(sol3.attention_share)
    with pytest.raises(AssertionError, match="PyTorch counted"):  # treats every head as a kv head
        ch03.check_decode_flops(lambda c, T: sol3.decode_flops(
            type(c)(**{**c.to_dict(), "n_kv_heads": c.n_heads}), T))
