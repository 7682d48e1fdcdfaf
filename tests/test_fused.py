"""The serving engine's fused layer on the CPU (lab/kernels/fused.py, llama.fused_block) and the fingerprint's
C++ sampler, against the reference operations they replace.

Oracles: `llama.rms_norm`, `llama.rope`, `F.silu(gate) * up`, `llama.block` (the reference layer) and
`fingerprint`'s PyTorch loop.

Tolerances. float32: the fused operations do the reference's arithmetic with the float sums in another
order (RMSNorm's sum of 576 squares, vectorised), so a result may move by a few units in the last place:
relative 1e-5 (the bound for reordering a sum of n = 576 positive terms is about n * 2^-24 = 3.4e-5; in
practice far less). bfloat16: each fused operation rounds to bfloat16 where the reference rounds, and the
statistics are float32 in both, so results are equal except where a float32 value (a sum in another
order, an exponential vectorised differently) lands on the other side of a bfloat16 rounding boundary. An
intermediate that flips (the normalised value before the weight, SiLU before the product) moves by one
step, and the final rounding can add one more: two steps. A bfloat16 step is at most 2^-7 of the value it
follows (8 significant bits: 2^-8 just below a power of two, 2^-7 just above), so the bound is
2 * 2^-7 * |reference|.
"""

import pytest
import torch
import torch.nn.functional as F

from lab import data
from lab.cache import StaticCache
from lab.kernels import cpu_kernel_available, fused
from lab.models import checks, forward_cached, load
from lab.models.gpt2 import split_heads
from lab.models.llama import Prepacked, block, fused_block, rms_norm, rope

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the fused path is off")
DTYPES = [torch.float32, torch.bfloat16]
STEP = 2.0 ** -7                        # a bfloat16 step, at most, relative to the value


def close(got, ref, steps=2) -> bool:
    """float32: within relative 1e-5; bfloat16: within `steps` bfloat16 steps of the reference's value. Raises
    AssertionError otherwise."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:
        gap = (got.float() - ref.float()).abs()
        assert (gap <= steps * STEP * ref.float().abs() + 1e-30).all(), f"max gap {gap.max()}"
    return True


def draw(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.1, 3.0, 300.0])      # real residual streams reach the hundreds
def test_add_rms_norm_matches_the_reference(dtype, scale):
    x, a = draw(2, 7, 576, dtype=dtype, scale=scale), draw(2, 7, 576, dtype=dtype, seed=1)
    w = (torch.rand(576, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    total, h = fused.add_rms_norm(x, w, 1e-5, add=a)
    assert torch.equal(total, x + a)                     # one rounding, as the reference's add
    assert close(h, rms_norm(x + a, w, 1e-5))
    total, h = fused.add_rms_norm(x, w, 1e-5)            # no add: the norm of x
    assert torch.equal(total, x)
    assert close(h, rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_the_reference_on_a_column_slice(dtype):
    qkv = draw(1, 11, 9 * 64 + 2 * 3 * 64, dtype=dtype)   # a merged q/k/v product: q is a column slice
    q = qkv[..., :9 * 64]
    cos, sin = draw(11, 64, dtype=dtype, seed=3), draw(11, 64, dtype=dtype, seed=4)
    ref = rope(split_heads(q, 9), cos, sin)               # [1, 9, 11, 64]
    rest = qkv[..., 9 * 64:].clone()
    assert fused.rope_(q, cos, sin, 9) is q
    assert close(split_heads(q, 9), ref)
    assert torch.equal(qkv[..., 9 * 64:], rest)           # k and v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_reference(dtype):
    gu = draw(3, 5, 2 * 1536, dtype=dtype, scale=4.0)
    gate, up = gu.split(1536, dim=-1)                       # views of the merged gate/up product
    assert close(fused.silu_mul(gate, up), F.silu(gate) * up)


def test_bad_inputs_are_refused():
    x = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        fused.add_rms_norm(x.double(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused.add_rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="add must match"):
        fused.add_rms_norm(x, torch.ones(64), 1e-5, add=torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="heads"):
        fused.rope_(x, torch.ones(4, 64), torch.ones(4, 64), heads=3)
    with pytest.raises(ValueError, match="cos must be"):
        fused.rope_(x, torch.ones(3, 64), torch.ones(4, 64), heads=1)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fused.silu_mul(x.transpose(1, 2), x.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_block_matches_the_reference_block_through_a_cache(smollm2, dtype):
    """The whole model, prefill then decode through a cache, fused layers against reference layers: float32
    within relative 1e-4 of the largest logit (30 layers of reordered sums); bfloat16 within 16 * 2^-8 of
    the largest logit, the bound tests/test_bf16.py sets for a cached decode against recomputation (a
    rounding that flips in one layer travels through the later ones); and the greedy token the same
    wherever the reference's top two logits are further apart than twice the largest difference."""
    model = smollm2 if dtype == torch.float32 else load("smollm2", dtype=dtype)
    w = Prepacked(model.weights)
    assert w.block is fused_block                          # the engine's weights bring the fused layer
    ids = torch.tensor(data.passages(model.tokenizer, n_tokens=48, count=1, seed=3))     # [1, 48] held-out text
    logits = {}
    for name, layer in (("reference", block), ("fused", fused_block)):
        w.block, cache = layer, StaticCache(model.config, 64, dtype=dtype)
        prefill = forward_cached(ids, w, model.config, cache)
        decode = forward_cached(ids[:, -1:], w, model.config, cache)
        logits[name] = torch.cat([prefill, decode], dim=1).float()
    ref, got = logits["reference"], logits["fused"]
    bound = (1e-4 if dtype == torch.float32 else 16 * 2.0 ** -8) * ref.abs().max()
    gap = (got - ref).abs().max()
    assert gap <= bound
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * gap         # positions where the difference cannot flip the winner
    assert clear.sum() >= 5                               # the comparison is not empty
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_fingerprint_in_cpp_reads_the_same_bytes_as_pytorch(monkeypatch):
    model = load("tiny-llama")
    weights = dict(model.weights) | {"small": torch.arange(10.0), "scalar": torch.tensor(2.0),
                                     "offset": torch.arange(300.0)[100:], "half": torch.randn(500).half()}
    fast = checks.fingerprint(weights)
    monkeypatch.setattr(checks, "sample_runs", lambda *a, **k: None)
    assert checks.fingerprint(weights) == fast
    runs = checks.FINGERPRINT_SAMPLES // checks.FINGERPRINT_RUN
    w = model.weights["model.embed_tokens.weight"].reshape(-1)
    step = w.numel() // runs
    head = w[:checks.FINGERPRINT_RUN].view(torch.uint8).numpy().tobytes()
    second = w[step:step + checks.FINGERPRINT_RUN].view(torch.uint8).numpy().tobytes()
    assert fast.startswith(head + second)                   # the first tensor's first two runs, in order


def test_fused_block_leaves_a_batch_of_rows_to_the_reference():
    """The fused operations take one row of tokens (a serving step's); a batch of rows goes through the
    reference layer, so the same prepacked weights still serve it, with the same logits."""
    model = load("tiny-llama")
    w = Prepacked(model.weights)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    out = forward_cached(ids, w, model.config, StaticCache(model.config, 16, batch_size=2))
    w.block = block
    assert torch.equal(out, forward_cached(ids, w, model.config, StaticCache(model.config, 16, batch_size=2)))


def test_the_fingerprints_kept_table_of_runs_follows_the_tensors():
    """The C++ sample keeps its table of runs for the same tensors at the same addresses: a write in place
    is read through it, and another tensor under the same name (another address or size), or the same
    tensors in another order, gets a new table. Each result is set beside the PyTorch loop's bytes."""
    def pytorch(weights):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(checks, "sample_runs", lambda *a, **k: None)
            return checks.fingerprint(weights)

    weights = dict(load("tiny-llama").weights)
    first = checks.fingerprint(weights)
    assert checks.fingerprint(weights) == first == pytorch(weights)           # the kept table
    name = next(iter(weights))
    with torch.inference_mode():
        weights[name].add_(1)                                                 # in place: same address
    written = checks.fingerprint(weights)
    assert written != first and written == pytorch(weights)
    weights[name] = weights[name].clone() + 1                                 # another tensor, another address
    assert checks.fingerprint(weights) == pytorch(weights) != written
    weights[name] = torch.cat([weights[name].reshape(-1), torch.ones(64)])    # another size
    assert checks.fingerprint(weights) == pytorch(weights)
    swapped = dict(reversed(list(weights.items())))                          # same tensors, another order
    assert checks.fingerprint(swapped) == pytorch(swapped) != checks.fingerprint(weights)
