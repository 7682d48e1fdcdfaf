"""Chapter 9's measurements, on the tiny model where they can run on it (the workloads that need a chat template
run on SmolLM2 in the notebook, which records the whole section in quick mode).

Oracles: plain greedy decoding (speculative_generate with NoDraft, itself checked against CachedBackend in
test_speculative.py) for the tokens of each timed run; the block table's length for the pages a crop frees.
"""

import pytest

from lab.experiments import ch09_speculation as ch09
from lab.models import load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_a_rollback_frees_the_page_that_held_only_rejected_guesses(tiny):
    s = dict(rollback_context=64, rollback_reps=3)
    r = ch09.rollback(tiny, s)
    assert set(r) == set(ch09.ROLLBACK_DESIGNS)
    # 60 positions, then 9: pages of 16 hold 60 + 9 = 69 positions in 5 pages; 61 kept need 4, one more needs 4
    assert r["paged"]["pages_freed"] == 1 and r["paged"]["pages_reserved"] == 0
    assert all(x["crop_us"] > 0 and x["step_ms"] > 0 for x in r.values())


def test_speed_runs_plain_and_each_draft_on_the_same_passage(tiny):
    s = dict(contexts=(64,), context_new=6, reps=1, speed_drafts=("lookup", "early1"))
    r = ch09.speed(tiny, s)[64]
    assert set(r) == {"plain", "lookup", "early1"}
    assert all(x["identical"] and x["tok_s"] > 0 for x in r.values())
    assert r["plain"]["per_step"] == 1


def test_the_long_copy_prompt_starts_the_passage_over(tiny):
    ids = ch09.long_copy(tiny, 96)
    assert len(ids) == 96 and ids[-16:] == ids[:16]                 # its end is its beginning again


def test_the_cache_share_of_a_step_grows_with_context(tiny):
    shares = [ch09.attention_share(tiny, c) for c in (16, 256, 4096)]
    assert 0 < shares[0] < shares[1] < shares[2] < 1


def test_the_timeline_marks_the_page_boundary_and_the_page_given_back(tmp_path):
    """A verify step from position 236 with 2 of 4 guesses kept, pages of 16: the boundary before 240 is drawn,
    and the page from 240 on (rejected positions only) is hatched as given back; nothing is hatched when the
    rejected positions share their page with accepted ones. Saved, so the legibility checks run."""
    from matplotlib.patches import Polygon, Rectangle

    def drawn(accepted):
        t = dict(page_size=16, start=236, guesses=4, accepted=accepted, pages_freed=int(accepted < 4))
        ax = ch09.plot_timeline(t, tmp_path / "timeline.png").axes[0]
        lines = [x for line in ax.get_lines() for x in line.get_xdata()]
        hatched = [p for p in ax.patches if p.get_hatch() and isinstance(p, (Polygon, Rectangle))]
        labels = ax.get_legend_handles_labels()[1]
        return lines, hatched, labels

    lines, hatched, labels = drawn(2)
    assert 239.5 in lines and "page boundary (pages of 16)" in labels
    assert len(hatched) == 1 and "page given back" in labels
    lines, hatched, labels = drawn(4)                   # every guess kept: position 240 is accepted, no page back
    assert not hatched and "page given back" not in labels
