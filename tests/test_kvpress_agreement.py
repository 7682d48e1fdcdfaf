"""The lab's loss against kvpress's (kvpress 0.5.5 with transformers 5.2.0 in `.venv-peers`, made by
`make peers`), and what a press does to it.

Oracle: with no press, kvpress's side is transformers' own Llama forward on the same converted SmolLM2
folder, float32, a DynamicCache filled by the context and the continuation scored on it. Its mean
next-token loss over the continuation must equal the lab's uncached `forward` on context + continuation.
Tolerance 1e-4 nats: the two forwards do the same float32 arithmetic in different orders (RoPE tables,
RMSNorm, grouped-query attention by repeat_kv or by SDPA's enable_gqa, a cached second call against one
call), so each logit differs by float32 rounding, about 1e-5 relative after 30 layers; the mean of 32
token losses moves by about 1e-6 (2e-7 measured at 1,024 + 256 tokens). 1e-4 leaves that margin and is
ten thousand times smaller than what StreamingLLM does to the recall below (over 1 nat).
"""

import pytest
import torch

from lab import data
from lab.models import forward
from lab.models.load import smollm2_folder
from lab.peers import compare_kvpress as kvpress

CONTEXT, CONTINUATION = 256, 32


def lab_loss(model, context, continuation) -> float:
    """Mean next-token NLL of `continuation` after `context`, by the lab's uncached forward."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = forward(ids, model.weights, model.config)[0]                      # [T, V]
    n = len(context)
    return torch.nn.functional.cross_entropy(logits[n - 1: -1], torch.tensor(continuation)).item()


# Slow (two kvpress runs, each a fresh Python importing torch, transformers and kvpress). One thread on
# both sides (conftest's `one_thread`, and kvpress's): on a busy 2-core machine a second thread mostly
# waits for a timeslice (measured here: a 288-token forward 2.4 s on one thread, 8-10 s on two; this test
# 35 s on one, 100 s on two, the machine busy). Marked peers: `make test-peers` builds kvpress's environment
# (`make peers`) and runs it; elsewhere it skips where that environment was not built.
@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not kvpress.available(), reason="kvpress's environment is not built here (make peers)")
def test_kvpress_without_a_press_equals_the_labs_loss_and_streaming_llm_forgets_the_middle(smollm2):
    """Two continuations of one held-out context: the text that follows it, and a recall, the context's
    own tokens 64..95 again. StreamingLLM at ratio 0.5 keeps positions 0-3 (sinks) and 132-255 (the
    recent half), so the recalled span is gone from its cache and the model can no longer copy it: the
    loss rose by 1.6 to 4.0 nats on six held-out passages. (On the text that follows, a press may even
    lower the loss: it did on 2 of 6 held-out passages at 512 + 64.)"""
    ids = data.passages(smollm2.tokenizer, CONTEXT + CONTINUATION, count=1, seed=0)[0]
    context, follows, recall = ids[:CONTEXT], ids[CONTEXT:], ids[64: 64 + CONTINUATION]

    plain = kvpress.run(smollm2_folder(), "none", 0.0, [context, context], [follows, recall], threads=1)
    assert plain["kvpress"] == "0.5.5" and plain["transformers"].startswith("5.2") and plain["threads"] == 1
    for theirs, continuation in zip(plain["results"], [follows, recall], strict=True):
        assert theirs["tokens"] == CONTINUATION and theirs["cache_length"] == CONTEXT and theirs["kept"] is None
        assert abs(theirs["loss"] - lab_loss(smollm2, context, continuation)) < 1e-4

    (streaming,) = kvpress.run(smollm2_folder(), "streaming_llm", 0.5, [context], [recall], n_sink=4,
                                threads=1)["results"]
    kept = CONTEXT // 2
    assert streaming["cache_length"] == kept
    expected = list(range(4)) + list(range(CONTEXT - (kept - 4), CONTEXT))          # sinks + recent window
    assert len(streaming["kept"]) == smollm2.config.n_layers
    assert all(head == expected for layer in streaming["kept"] for head in layer)
    assert streaming["loss"] > plain["results"][1]["loss"] + 1.0                   # measured: 1.6-4.0 nats more


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not kvpress.available(), reason="kvpress's environment is not built here (make peers)")
def test_the_labs_evicting_cache_keeps_what_kvpress_keeps_at_the_same_ratio(smollm2):
    """The lab's sinks and SnapKV policies (SnapKV with kvpress's window of 64 and pooling width 5) against
    kvpress's StreamingLLM and SnapKV presses at ratio 0.5, kvpress's own protocol (against_kvpress):
    every layer and KV head keeps the same positions (Jaccard 1), so the continuation's loss and its KL to
    the uncompressed model agree to float32 rounding (the 1e-4 of the module docstring; 1e-5 measured)."""
    from lab.peers.kvpress_agreement import against_kvpress

    ids = data.passages(smollm2.tokenizer, CONTEXT + CONTINUATION, count=2, seed=1)
    contexts, continuations = [x[:CONTEXT] for x in ids], [x[CONTEXT:] for x in ids]
    r = against_kvpress(smollm2, contexts, continuations, 0.5)
    for press in ("streaming_llm", "snapkv"):
        x = r[press]
        assert x["overlap"] == [1.0, 1.0], press
        assert x["budget"] == x["peer_cache_length"] == [CONTEXT // 2] * 2
        for ours, theirs in zip(x["lab_loss"] + x["lab_kl"], x["peer_loss"] + x["peer_kl"], strict=True):
            assert abs(ours - theirs) < 1e-4, (press, ours, theirs)
    assert all(kl > 1e-3 for kl in r["snapkv"]["lab_kl"])                   # the press did change something


def test_a_missing_kvpress_environment_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(kvpress, "PEERS_PYTHON", tmp_path / "missing" / "python")
    with pytest.raises(FileNotFoundError, match="make peers"):
        kvpress.run("model", "snapkv", 0.5, [[1, 2, 3]], [[4, 5]])


@pytest.mark.parametrize("press, ratio", [("h2o", 0.5), ("snapkv", 1.0), ("knorm", -0.1)])
def test_an_unknown_press_or_a_ratio_outside_0_to_1_is_refused_before_starting_kvpress(press, ratio):
    with pytest.raises(ValueError):
        kvpress.run("model", press, ratio, [[1, 2, 3]], [[4, 5]])
