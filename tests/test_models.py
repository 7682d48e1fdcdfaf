"""lab.models: forwards against transformers, the SmolLM2 folder, tokenizers, manifests, load and input errors.

Oracles: the transformers model on the same weights (`to_transformers`), transformers reading the converted
SmolLM2 folder on its own, transformers' tokenizer, hashlib over the files, and hand-written numbers.
"""

import hashlib
import json
import re
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from lab import data
from lab.cache import cache_bytes
from lab.models import InputError, Model, ModelConfig, forward, load, random_model
from lab.models.hf import to_transformers
from lab.models.load import RANDOM, _hash_files, smollm2_folder
from lab.models.published import PUBLISHED
from lab.models.tokenizer import ByteTokenizer, Tokenizer

TINY = ["tiny-gpt2", "tiny-llama", "tiny-mqa"]


def seeded_ids(vocab_size, batch, tokens, seed=0):
    return torch.randint(0, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(ids).logits


@pytest.fixture(scope="module")
def tiny_pairs():
    """Each tiny model with its transformers twin, built once (building the twin costs ~0.1 s)."""
    out = {}
    for name in TINY:
        model = load(name)
        out[name] = (model, to_transformers(model))
    return out


# ---- parity with transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_matches_transformers(name, tiny_pairs):
    model, hf = tiny_pairs[name]
    ids = seeded_ids(model.config.vocab_size, batch=2, tokens=50)
    ours, ref = forward(ids, model.weights, model.config), hf_logits(hf, ids)
    assert ours.shape == ref.shape == (2, 50, model.config.vocab_size)
    # Logits here are below 1 in magnitude and pass through 2 layers of width <= 256: fp32 rounding
    # (~1.2e-7 per op) stays orders of magnitude below 1e-5; a wrong norm, mask or RoPE gives ~1e-2.
    assert (ours - ref).abs().max().item() < 1e-5


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(TINY), batch=st.integers(1, 3), tokens=st.integers(1, 64),
       seed=st.integers(0, 2**16))
def test_tiny_forward_matches_transformers_for_any_shape(tiny_pairs, name, batch, tokens, seed):
    model, hf = tiny_pairs[name]
    ids = seeded_ids(model.config.vocab_size, batch, tokens, seed)
    # Same tolerance and reason as above: 2 layers, |logit| < 1, fp32.
    assert (forward(ids, model.weights, model.config) - hf_logits(hf, ids)).abs().max().item() < 1e-5


def test_gpt2_random_forward_matches_transformers():
    model = load("gpt2-random")
    ids = seeded_ids(model.config.vocab_size, batch=1, tokens=64)
    ours, ref = forward(ids, model.weights, model.config), hf_logits(to_transformers(model), ids)
    # fp32 accumulates ~1e-7 relative per op; 12 layers of dot products of length up to 3072 stay
    # well inside 1e-4 of the largest logit.
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


@pytest.fixture(scope="module")
def smollm2_ids(smollm2):
    return torch.tensor(data.passages(smollm2.tokenizer, n_tokens=128, count=1, seed=0))  # [1, 128]


def test_smollm2_forward_matches_transformers(smollm2, smollm2_ids):
    ours = forward(smollm2_ids, smollm2.weights, smollm2.config)
    ref = hf_logits(to_transformers(smollm2), smollm2_ids)
    # 30 layers of dot products of length up to 1536, fp32 (~1e-7 relative per op): 1e-4 of the largest
    # |logit| (about 35 here) is ample for rounding and far below any real error.
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_smollm2_folder_loaded_by_transformers_gives_same_logits(smollm2, smollm2_ids):
    """Checks the converted folder itself (config.json, tied head, weights), not only to_transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_folder()), dtype=torch.float32).eval()
    ours, ref = forward(smollm2_ids, smollm2.weights, smollm2.config), hf_logits(hf, smollm2_ids)
    # Same tolerance and reason as the parity test above.
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("name", TINY)
def test_last_only_is_the_last_row(name, tiny_pairs):
    model = tiny_pairs[name][0]
    ids = seeded_ids(model.config.vocab_size, batch=2, tokens=33, seed=1)
    full = forward(ids, model.weights, model.config)
    last = forward(ids, model.weights, model.config, last_only=True)
    assert last.shape == (2, 1, model.config.vocab_size)
    # Same layers on the same rows; only the head's matmul has a different shape, which may change the
    # BLAS blocking: assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5) cover that reordering.
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.parametrize("name", TINY)
def test_forward_is_causal(name, tiny_pairs):
    """Changing a later token leaves every earlier position's logits unchanged (recomputation oracle)."""
    model = tiny_pairs[name][0]
    ids = seeded_ids(model.config.vocab_size, batch=1, tokens=20, seed=2)
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % model.config.vocab_size
    a, b = forward(ids, model.weights, model.config), forward(changed, model.weights, model.config)
    # fp32 defaults: positions before 12 run the same arithmetic, at most reordered by masked-out terms.
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # and the change is seen from position 12 on


# ---- SmolLM2: config and sanity --------------------------------------------------------------------------

def test_smollm2_config_matches_published_shape(smollm2):
    published = next(p for p in PUBLISHED if p.name == "SmolLM2-135M")
    c = smollm2.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        published.n_layers, published.n_heads, published.n_kv_heads, published.head_dim) == (30, 9, 3, 64)
    assert c.arch == "llama"
    assert c.vocab_size == 49152
    assert c.d_model == 576
    assert c.tie_embeddings is True
    assert c.rope_theta == 100000.0
    assert "lm_head.weight" not in smollm2.weights  # tied: the head is the embedding


def test_smollm2_kv_bytes_per_token(smollm2):
    # Hand-computed: 2 (K and V) x 30 layers x 3 kv heads x 64 dims x 4 bytes = 46,080 bytes per token.
    assert cache_bytes(smollm2.config, tokens=1) == 46_080
    assert cache_bytes(smollm2.config, tokens=10, batch_size=3, dtype=torch.float16) == 46_080 // 2 * 30


def test_smollm2_says_paris(smollm2):
    ids = torch.tensor([smollm2.tokenizer.encode("The capital of France is")])
    logits = forward(ids, smollm2.weights, smollm2.config, last_only=True)
    assert smollm2.tokenizer.decode([logits[0, -1].argmax()]) == " Paris"


# ---- tokenizer ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def test_tokenizer_round_trip_on_shakespeare(smollm2, hf_tokenizer):
    text = data.plays()["hamlet"][:3000]
    ids = smollm2.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)  # transformers' tokenizer as oracle
    assert len(ids) < len(text) / 2  # a real BPE, not bytes
    assert smollm2.tokenizer.decode(ids) == text


def test_chat_template_renders_like_transformers(smollm2, hf_tokenizer):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ours = smollm2.tokenizer.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is a KV cache?<|im_end|>" in ours
    assert ours.endswith("<|im_start|>assistant\n")
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_template_missing_raises(smollm2):
    bare = Tokenizer(smollm2.tokenizer.tok)  # the same BPE without its template
    assert bare.sha256 != smollm2.tokenizer.sha256  # the template is part of the tokenizer's identity
    with pytest.raises(ValueError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_byte_tokenizer_chat_template_raises_value_error():
    with pytest.raises(ValueError, match="chat template"):
        load("tiny-llama").tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_hashes_differ(smollm2):
    assert re.fullmatch(r"[0-9a-f]{64}", smollm2.tokenizer.sha256)
    assert smollm2.tokenizer.sha256 != ByteTokenizer().sha256
    assert load("smollm2").tokenizer.sha256 == smollm2.tokenizer.sha256  # stable across loads


def test_byte_tokenizer_round_trip():
    text = "To be, or not to be — that is the question"
    tok = ByteTokenizer()
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


# ---- manifests --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "smollm2"])
def test_manifest_is_hex_and_stable_across_loads(name):
    a, b = load(name).manifest, load(name).manifest
    assert re.fullmatch(r"[0-9a-f]{64}", a)
    assert a == b


def test_manifest_changes_with_one_weight_element():
    config = RANDOM["tiny-llama"]
    base = random_model(config, seed=0)
    weights = {k: v.clone() for k, v in base.weights.items()}
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 1e-3
    changed = Model(base.name, config, weights, base.tokenizer)  # a new object: its own manifest memo
    same = Model(base.name, config, {k: v.clone() for k, v in base.weights.items()}, base.tokenizer)
    assert changed.manifest != base.manifest
    assert same.manifest == base.manifest
    assert random_model(config, seed=1).manifest != base.manifest


def test_manifest_covers_the_config():
    base = random_model(RANDOM["tiny-mqa"])
    renamed = Model("x", ModelConfig(**{**base.config.to_dict(), "norm_eps": 1e-6}), base.weights, base.tokenizer)
    assert renamed.manifest != base.manifest


def independent_file_hash(files):
    """sha256 over name + NUL + bytes of each file, in order: the layout `_hash_files` documents."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def test_smollm2_manifest_is_sha256_of_its_files(smollm2):
    folder = smollm2_folder()
    assert [f.name for f in smollm2.files] == ["config.json", "model.safetensors"]
    assert all(f.parent == folder for f in smollm2.files)
    assert smollm2.manifest == independent_file_hash(smollm2.files)


# ---- load: names, errors, the real GPT-2 from a local Hugging Face cache ----------------------------------

def test_load_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as err:
        load("no-such-model")
    assert "smollm2" in str(err.value) and "gpt2-random" in str(err.value)


def test_load_gpt2_without_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        load("gpt2")
    message = str(err.value)
    assert "download" in message and "openai-community/gpt2" in message
    assert str(tmp_path) in message  # says where it looked


@pytest.fixture
def fake_gpt2_cache(tmp_path, monkeypatch):
    """A local HF cache holding 'openai-community/gpt2' as the real repo stores it, with tiny weights."""
    tokenizer_json = smollm2_folder() / "tokenizer.json"  # resolve before LAB_CACHE moves
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "lab-cache"))  # keep the manifest memo out of ~/.cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    source = random_model(RANDOM["tiny-gpt2"], seed=3)
    (snapshot / "config.json").write_text(json.dumps({**RANDOM["tiny-gpt2"].to_hf(), "model_type": "gpt2"}))
    # The real repo stores GPT2Model's names (no "transformer." prefix) plus the causal-mask buffers.
    stored = {k.removeprefix("transformer."): v.contiguous() for k, v in source.weights.items()}
    for i in range(source.config.n_layers):
        stored[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(stored, str(snapshot / "model.safetensors"))
    shutil.copy(tokenizer_json, snapshot / "tokenizer.json")
    return source, snapshot


def test_load_gpt2_from_local_hf_cache(fake_gpt2_cache):
    source, snapshot = fake_gpt2_cache
    model = load("gpt2")
    assert model.config == ModelConfig.from_hf(source.config.to_hf(), name="gpt2")
    assert sorted(model.weights) == sorted(source.weights)  # prefix restored, mask buffers dropped
    ids = seeded_ids(source.config.vocab_size, batch=2, tokens=40)
    # Same weights, same code: bit-identical.
    assert torch.equal(forward(ids, model.weights, model.config), forward(ids, source.weights, source.config))
    assert model.tokenizer.vocab_size == 49152  # the snapshot's tokenizer.json, not bytes
    assert model.manifest == independent_file_hash([snapshot / "config.json", snapshot / "model.safetensors"])


def test_load_repo_id_and_local_folder(fake_gpt2_cache):
    source, snapshot = fake_gpt2_cache
    ids = seeded_ids(source.config.vocab_size, batch=1, tokens=16)
    expected = forward(ids, source.weights, source.config)
    for name in ("openai-community/gpt2", str(snapshot)):
        model = load(name)
        assert torch.equal(forward(ids, model.weights, model.config), expected), name


def test_hash_files_recomputes_with_empty_memo(fake_gpt2_cache):
    _, snapshot = fake_gpt2_cache
    files = [snapshot / "config.json", snapshot / "model.safetensors"]
    assert _hash_files(files) == independent_file_hash(files)
    assert _hash_files(files[::-1]) == independent_file_hash(files[::-1]) != independent_file_hash(files)


# ---- forward input errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, word", [
    ([[1, 2, 3]], "Tensor"),                                   # a list, not a tensor
    (torch.tensor([1, 2, 3]), "rank"),                         # rank 1
    (torch.zeros(1, 2, 3, dtype=torch.long), "rank"),          # rank 3
    (torch.tensor([[1.0, 2.0]]), "integer"),                   # float ids
    (torch.tensor([[1, 320]]), "vocabulary"),                  # == vocab_size
    (torch.tensor([[-1, 2]]), "vocabulary"),                   # negative
    (torch.zeros(1, 0, dtype=torch.long), "empty"),            # no tokens
    (torch.zeros(1, 513, dtype=torch.long), "position"),       # beyond tiny-gpt2's table of 512
], ids=["list", "rank1", "rank3", "float", "id_eq_vocab", "negative", "empty", "too_many_positions"])
def test_forward_rejects_bad_ids(ids, word):
    model = load("tiny-gpt2")
    with pytest.raises(InputError, match=word):
        forward(ids, model.weights, model.config)


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


def test_forward_error_names_the_bad_id():
    model = load("tiny-llama")
    with pytest.raises(InputError, match=r"token id 320 .*0 \.\. 319"):
        forward(torch.tensor([[5, 320]]), model.weights, model.config)
    with pytest.raises(InputError, match="token id -7"):
        forward(torch.tensor([[-7, 5]]), model.weights, model.config)


def test_forward_accepts_the_full_position_table():
    model = load("tiny-gpt2")  # 512 learned positions: exactly 512 tokens is allowed
    assert forward(torch.zeros(1, 512, dtype=torch.long), model.weights, model.config, last_only=True).shape == (
        1, 1, 320)


def test_forward_accepts_int32_ids():
    model = load("tiny-llama")
    ids = seeded_ids(320, 1, 10)
    assert torch.equal(forward(ids.int(), model.weights, model.config), forward(ids, model.weights, model.config))


def test_forward_rejects_empty_batch():
    model = load("tiny-llama")
    with pytest.raises(InputError, match="empty"):
        forward(torch.zeros(0, 5, dtype=torch.long), model.weights, model.config)


# ---- ModelConfig ------------------------------------------------------------------------------------------------

def test_config_rejects_heads_not_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(arch="llama", n_heads=4, n_kv_heads=3)


def test_config_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="mamba")


@pytest.mark.parametrize("name", [*TINY, "gpt2-random"])
def test_config_hf_round_trip(name):
    config = RANDOM[name]
    assert ModelConfig.from_hf(config.to_hf(), name=config.name) == config


def test_config_from_hf_reads_transformers_own_config():
    """transformers' serialised Llama config (rope_parameters, not rope_theta) reads back the same shape."""
    from transformers import AutoConfig

    config = RANDOM["tiny-llama"]
    hf = dict(config.to_hf())
    hf_dict = AutoConfig.for_model(hf.pop("model_type"), **hf).to_dict()
    assert ModelConfig.from_hf(hf_dict, name=config.name) == config


def test_group_size():
    assert [RANDOM[n].group_size for n in TINY] == [1, 2, 4]


def test_prepacked_projections_compute_the_same_forward(smollm2, smollm2_ids):
    """Prepacked (oneDNN's blocked layout, CPU serving) against F.linear on the same weights. Tolerance: both
    sum the same float32 products in another order; over SmolLM2's 30 layers the logits differ by about
    1e-4, far below the ~1e-2 gap between the top two logits of a held-out token, so 1e-3."""
    from lab.models.checks import owner
    from lab.models.llama import Prepacked

    packed = Prepacked(smollm2.weights)
    assert owner(packed, smollm2.config) == owner(smollm2.weights, smollm2.config)   # the same tensors
    assert len(packed.packed) == 4 * smollm2.config.n_layers + 1    # qkv, o, gate_up, down per layer; the head
    with torch.inference_mode():
        want, got = forward(smollm2_ids, smollm2.weights, smollm2.config), forward(smollm2_ids, packed, smollm2.config)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
