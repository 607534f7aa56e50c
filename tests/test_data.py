import numpy as np
import pytest
import torch

from minigpt.core import data as data_module
from minigpt.core import tokens as tokens_module
from minigpt.config import EOT, UsageError, parse_args
from minigpt.core.data import Batches, ToyBatches, tokenizer_vocab
from minigpt.core.tokens import builtin_corpus, get_tokenizer, load_tokens, tokenize_file


def test_gpt2_ids_are_exact_and_offline():
    enc = get_tokenizer("gpt2")
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == EOT
    text = "GPT-2's tokenizer:  it's   “unicode” too 🙂\n"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_builtin_corpus_is_real_prose():
    tokens = load_tokens([builtin_corpus()])
    assert len(tokens) > 100_000
    assert "the" in get_tokenizer().decode(tokens[:2000].tolist())


def test_builtin_validation_is_a_tenth_spread_over_the_corpus():
    """The held-out text is drawn as the training text is: a tenth of the corpus in stretches from
    every part of it, not its alphabetical last tenth (typesseq's tables: 42% whitespace-only
    tokens against the rest's 18-31%), and nothing is in both."""
    train, val = data_module.builtin_split()
    whole = builtin_corpus().read_text()
    assert len(train) + len(val) == len(whole) and 0.08 < len(val) / len(whole) < 0.12
    # the k-th tenth of the held-out text comes from the k-th tenth of the corpus, and not from training
    found = [0]  # each probe searched for after the one before: the corpus repeats some of its tables
    for k in range(10):
        found.append(whole.find(val[(2 * k + 1) * len(val) // 20 :][:200], found[-1]))
    assert [at * 10 // len(whole) for at in found[1:]] == list(range(10))

    def whitespace_share(text):
        enc = get_tokenizer()
        ids = data_module.cached_tokens(text.encode(), "probe", "gpt2", "probe").tolist()
        return sum(not enc.decode([i]).strip() for i in ids) / len(ids)

    assert abs(whitespace_share(val) - whitespace_share(train)) < 0.05


def test_default_data_holds_out_the_split_and_a_changed_split_is_tokenised_again(monkeypatch):
    cfg = parse_args(["--max-tokens", "5000"])
    d = data_module.load_data(cfg, 0, pin=False)
    _, val = data_module.builtin_split()
    val_ids = data_module.cached_tokens(val.encode(), "pydoc_topics_val", "gpt2", "held out")
    assert d.train_tokens == 5000 and d.val_tokens == len(val_ids)  # the cap: training only
    monkeypatch.setattr(data_module, "SPLIT_PIECES", 50)  # another split: another text, another token file
    _, other = data_module.builtin_split()
    other_ids = data_module.cached_tokens(other.encode(), "pydoc_topics_val", "gpt2", "held out")
    assert other_ids.filename != val_ids.filename
    assert get_tokenizer().decode(other_ids.tolist()) == other


def test_token_file_is_cached_by_content(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one two three")
    first = tokenize_file(f)
    again = tokenize_file(f)
    assert first.filename == again.filename  # same content: the cached file is reused
    f.write_text("one two three four")
    edited = tokenize_file(f)
    assert edited.filename != first.filename
    assert get_tokenizer().decode(edited.tolist()) == "one two three four"


def test_files_are_joined_by_endoftext_and_capped(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world")
    (tmp_path / "b.txt").write_text("Hello")
    tokens = load_tokens([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert tokens.tolist() == [15496, 995, EOT, 15496]
    assert load_tokens([tmp_path / "a.txt", tmp_path / "b.txt"], max_tokens=2).tolist() == [15496, 995]


def test_windows_shift_by_one_and_are_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    b = Batches(tokens, batch_size=4, seq_len=8, seed=7)
    x, y = next(b)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    assert int(y.max()) < 1000
    again = Batches(tokens, batch_size=4, seq_len=8, seed=7)
    assert torch.equal(next(again)[0], x)
    # the position alone says where the sequence continues
    second = next(b)[0]
    assert torch.equal(next(Batches(tokens, 4, 8, seed=7, position=1))[0], second)
    assert not torch.equal(next(Batches(tokens, 4, 8, seed=8))[0], x)
    assert not torch.equal(next(Batches(tokens, 4, 8, seed=7, rank=1))[0], x)


def test_windows_reach_both_ends():
    tokens = np.arange(10, dtype=np.uint16)
    b = Batches(tokens, batch_size=64, seq_len=8, seed=0)
    firsts = {int(v) for _ in range(5) for v in next(b)[0][:, 0]}
    assert firsts == {0, 1}  # 10 tokens hold exactly two windows of 9


def test_toy_batches_are_arithmetic_sequences():
    x, y = next(ToyBatches(vocab_size=50, batch_size=8, seq_len=12, seed=0))
    stride = (y - x) % 50
    assert (stride == stride[:, :1]).all() and ((stride >= 1) & (stride <= 4)).all()


@pytest.mark.parametrize(
    "content, message", [(None, "does not exist"), ("", "is empty"), (b"\xff\xfe\x00", "not UTF-8")]
)
def test_bad_files_are_usage_errors(tmp_path, content, message):
    f = tmp_path / "data.txt"
    if isinstance(content, str):
        f.write_text(content)
    elif content is not None:
        f.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        tokenize_file(f)


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "secret.txt"
    f.write_text("x")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(f), "read_bytes", denied)  # root would read a chmod-0 file anyway
    with pytest.raises(UsageError, match="cannot read .*Permission denied"):
        tokenize_file(f)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        tokenize_file(tmp_path)


def test_tokenizer_vocab_is_the_encoders():
    assert tokenizer_vocab("gpt2") == get_tokenizer("gpt2").n_vocab == EOT + 1


def test_cached_tokens_never_build_the_tokenizer(tmp_path, monkeypatch):
    """The encoder costs about 50 MiB for the whole run: a run whose tokens are cached skips it."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    get_tokenizer.cache_clear()
    first = tokenize_file(text)  # tokenises and writes the cache
    assert get_tokenizer.cache_info().currsize == 0  # the encoder was let go after tokenising

    def no_encoder(name="gpt2"):
        raise AssertionError("the encoder was built for cached tokens")

    monkeypatch.setattr(tokens_module, "build_tokenizer", no_encoder)
    again = tokenize_file(text)
    assert np.array_equal(np.asarray(again), np.asarray(first))


def test_a_path_under_home_reads_the_same_for_every_user(monkeypatch, tmp_path):
    from minigpt.fileio import display_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert display_path(tmp_path / ".cache" / "minigpt" / "x.json") == "~/.cache/minigpt/x.json"
    assert display_path("/elsewhere/x.json") == "/elsewhere/x.json"
