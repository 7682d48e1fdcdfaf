"""llama.cpp beside the lab (lab/peers/llamacpp.py, lab/experiments/llamacpp.py).

Without llama.cpp: the GGUF writer's row order for queries and keys is exactly what transformers' GGUF reader
undoes (its own code is the oracle), the float32 file holds the dequantized Q4_1 weights bit for bit, the
load generator reads llama-server's own stream, and peers get an environment without the lab's OpenMP
settings. With llama.cpp built (`make llamacpp`, marked peers): llama-server's greedy answers on the float32
file equal the lab's engine token for token (same weights, both in float32; a difference of rounding order
could flip a near-tie, so the check is on held-out text where we measured none), and llama-bench runs.
"""

import io
import json

import numpy as np
import pytest

from lab import loadgen, threads
from lab.peers import llamacpp


@pytest.mark.parametrize("heads", [9, 3])                      # SmolLM2's query heads and key heads
def test_rope_rows_is_what_transformers_gguf_reader_undoes(heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    w = np.random.default_rng(0).standard_normal((heads * 64, 576)).astype(np.float32)
    undone = LlamaTensorProcessor()._reverse_permute_weights(llamacpp.rope_rows(w, heads), heads)
    assert np.array_equal(undone, w)
    assert not np.array_equal(llamacpp.rope_rows(w, heads), w)


@pytest.mark.slow                                                 # writes and reads 540 MB: about 13 s
def test_the_float32_file_holds_the_dequantized_q4_1_weights_bit_for_bit(tmp_path):
    path = llamacpp.write_gguf(tmp_path / "f32.gguf", "float32")
    agree = llamacpp.weights_agree(path)
    assert agree["tensors"] == 272 and agree["identical"] == 272 and agree["max_abs_diff"] == 0.0
    with pytest.raises(ValueError, match="dtype"):
        llamacpp.write_gguf(tmp_path / "x.gguf", "float16")


def test_the_load_generator_reads_llama_servers_own_stream():
    """/completion streams one chunk per token with `tokens`, then one with stop true (and no [DONE])."""
    chunks = [dict(index=0, content="a", tokens=[5], stop=False), dict(index=0, content="b", tokens=[7], stop=False),
              dict(index=0, content="", tokens=[], stop=True, stop_type="limit")]
    stream = io.BytesIO(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks))
    rec = loadgen.Record(0.0, 2)
    loadgen.read_events(stream, rec, clock=lambda: 1.0)
    assert rec.done and rec.token_ids == [5, 7] and rec.tokens == 2 and rec.finish_reason == "length"
    cut = io.BytesIO(b"data: " + json.dumps(chunks[0]).encode() + b"\n\n")
    rec = loadgen.Record(0.0, 2)
    loadgen.read_events(cut, rec, clock=lambda: 1.0)
    assert not rec.done and rec.error


def test_peers_start_without_the_labs_openmp_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = threads.peer_env(X=1)
    assert "OMP_WAIT_POLICY" not in env and "OMP_NUM_THREADS" not in env and env["X"] == "1"
    assert "PATH" in env


needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp is not built here (make llamacpp)")


@pytest.mark.peers
@needs_llamacpp
def test_llama_server_answers_as_the_labs_engine_on_the_same_float32_weights():
    from lab import data
    from lab.engine import ServingEngine
    from lab.models import load

    model = load("smollm2")
    prompts = data.passages(model.tokenizer, 64, 3)
    ours = ServingEngine(model, num_pages=64).generate(prompts, 16)
    with llamacpp.server(llamacpp.model_files()["float32"], slots=1, context=128) as (_, url):
        assert llamacpp.greedy(url, prompts, 16) == ours


@pytest.mark.peers
@needs_llamacpp
def test_llama_bench_decodes_after_a_context():
    r = llamacpp.bench(llamacpp.model_files()["q4_1"], depth=32, new_tokens=4)
    assert r["tok_s"] > 0 and r["depth"] == 32 and r["threads"] == 2
