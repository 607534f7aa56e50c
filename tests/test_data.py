"""Text in, batches out: GPT-2's exact ids offline, the built-in corpus and its held-out tenth,
the token cache keyed by text and tokenizer, --train-data/--val-data's files, and the batches."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minigpt.config import EOT, GPT2_VOCAB, UsageError, parse_args
from minigpt.core import data as data_module
from minigpt.core import tokens as tokens_module
from minigpt.core.data import Batches, builtin_split, builtin_tokens, cached_tokens, gpt2_tokenizer
from minigpt.core.tokens import encoding, load_files, registry_tokenizer, user_tokens
from minigpt.core.toy import ToyBatches, toy_data


def ids_of(*paths, name="gpt2"):
    return np.asarray(load_files([str(p) for p in paths], "--train-data", name, say=False))


def token_files(cache) -> list:
    return sorted((cache / "tokens").glob("*.tok"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(data_module.CACHE_ENV, str(folder))
    return folder


def test_gpt2_ids_are_exact_and_offline():
    enc = gpt2_tokenizer()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == GPT2_VOCAB and enc.eot_token == EOT
    text = "GPT-2's tokenizer:  it's   “unicode” too 🙂\n"
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert encoding("gpt2") is enc  # --tokenizer-name gpt2 is the offline one


def test_builtin_corpus_is_real_prose():
    train, val, vocab = builtin_tokens()
    assert len(train) > 100_000 and vocab == GPT2_VOCAB
    assert "the" in gpt2_tokenizer().decode(train[:2000].tolist())


def test_builtin_validation_is_a_tenth_spread_over_the_corpus():
    """The held-out text is drawn as the training text is: a tenth of the corpus in stretches from
    every part of it, not its alphabetical last tenth (typesseq's tables: 42% whitespace-only
    tokens against the rest's 18-31%), and nothing is in both."""
    train, val = builtin_split()
    whole = builtin_split(pieces=1)[0]  # one piece, none held out: the corpus as it is
    assert len(train) + len(val) == len(whole) and 0.08 < len(val) / len(whole) < 0.12
    # the k-th tenth of the held-out text comes from the k-th tenth of the corpus, and not from training
    found = [0]  # each probe searched for after the one before: the corpus repeats some of its tables
    for k in range(10):
        found.append(whole.find(val[(2 * k + 1) * len(val) // 20 :][:200], found[-1]))
    assert [at * 10 // len(whole) for at in found[1:]] == list(range(10))

    def whitespace_share(text):
        enc = gpt2_tokenizer()
        ids = cached_tokens(text.encode(), "probe").tolist()
        return sum(not enc.decode([i]).strip() for i in ids) / len(ids)

    assert abs(whitespace_share(val) - whitespace_share(train)) < 0.05


def test_default_data_holds_out_the_split_and_a_changed_split_is_tokenised_again(cache):
    cfg = parse_args(["--max-tokens", "5000"])
    d = data_module.load_data(cfg, builtin_tokens(), 0, pin=False)
    _, val = builtin_split()
    val_ids = cached_tokens(val.encode(), "pydoc_topics_val")
    assert d.train_tokens == 5000 and d.val_tokens == len(val_ids)  # the cap: training only
    before = set(token_files(cache))
    _, other = builtin_split(pieces=50)  # another split: another text, another token file
    other_ids = cached_tokens(other.encode(), "pydoc_topics_val")
    assert len(set(token_files(cache)) - before) == 1
    assert gpt2_tokenizer().decode(other_ids.tolist()) == other


def test_token_file_is_cached_by_content(tmp_path, cache):
    f = tmp_path / "a.txt"
    f.write_text("one two three")
    first = ids_of(f)
    again = load_files([str(f)], "--train-data", "gpt2", say=False)  # read from the cache: memory-mapped
    assert isinstance(again.parts[0], np.memmap) and np.array_equal(first, again)
    assert len(token_files(cache)) == 1
    f.write_text("one two three four")
    edited = ids_of(f)
    assert len(token_files(cache)) == 2
    assert gpt2_tokenizer().decode(edited.tolist()) == "one two three four"


def test_a_token_file_is_keyed_by_its_tokenizer_too(tmp_path, cache, monkeypatch):
    """The same text under another tokenizer is another token file, never the first one's ids."""
    other = SimpleNamespace(n_vocab=GPT2_VOCAB, eot_token=EOT, encode_ordinary=lambda text: [7] * len(text))
    monkeypatch.setattr(
        tokens_module, "registry_tokenizer", lambda name: gpt2_tokenizer() if name == "gpt2" else other
    )
    f = tmp_path / "a.txt"
    f.write_text("one two")
    assert ids_of(f).tolist() == [505, 734]
    assert ids_of(f, name="other").tolist() == [7] * 7
    assert len(token_files(cache)) == 2


def test_files_are_joined_by_endoftext_and_the_tenth_held_out(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world")
    (tmp_path / "b.txt").write_text("Hello")
    assert ids_of(tmp_path / "a.txt", tmp_path / "b.txt").tolist() == [15496, 995, EOT, 15496]
    (tmp_path / "c.txt").write_text("one two three four five six seven eight nine ten")
    cfg = parse_args(["--train-data", str(tmp_path / "c.txt")])
    train, val, vocab = user_tokens(cfg, is_main=True)
    assert (len(train), len(val), vocab) == (9, 1, GPT2_VOCAB)  # the last tenth, contiguous
    cfg = parse_args(["--train-data", str(tmp_path / "c.txt"), "--val-data", str(tmp_path / "a.txt")])
    train, val, _ = user_tokens(cfg, is_main=True)
    assert len(train) == 10 and np.asarray(val).tolist() == [15496, 995]  # --val-data: all of it trains


def test_val_data_alone_trains_on_the_whole_builtin_corpus(tmp_path):
    (tmp_path / "v.txt").write_text("Hello world")
    train, val, _ = user_tokens(parse_args(["--val-data", str(tmp_path / "v.txt")]), is_main=True)
    builtin_train, builtin_val, _ = builtin_tokens()
    whole = len(builtin_train) + len(builtin_val)
    assert abs(len(train) - whole) < whole / 100 and np.asarray(val).tolist() == [15496, 995]


def test_another_tokenizer_reads_the_builtin_corpus_through_the_registry(cache, monkeypatch):
    """--tokenizer-name NAME without data files: the built-in corpus's split, in NAME's ids."""
    import tiktoken

    gpt2 = gpt2_tokenizer()
    r50k = tiktoken.Encoding("r50k_base", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                             special_tokens={"<|endoftext|>": EOT})  # fmt: skip
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: r50k if name == "r50k_base" else 1 / 0)
    registry_tokenizer.cache_clear()
    try:
        train, val, vocab = user_tokens(parse_args(["--tokenizer-name", "r50k_base"]), is_main=True)
        assert np.array_equal(train, builtin_tokens()[0]) and vocab == r50k.n_vocab
        with pytest.raises(UsageError) as e:
            user_tokens(parse_args(["--tokenizer-name", "nosuch"]), is_main=True)
        assert "tokenizer 'nosuch' is not available" in str(e.value) and "gpt2" in str(e.value)
    finally:
        registry_tokenizer.cache_clear()


def test_a_tokenizer_with_more_ids_than_a_token_file_holds_is_refused(monkeypatch):
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: SimpleNamespace(n_vocab=100_277))
    registry_tokenizer.cache_clear()
    try:
        with pytest.raises(UsageError, match="100,277 ids, more than the 65,536"):
            registry_tokenizer("cl100k_base")
    finally:
        registry_tokenizer.cache_clear()


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
    x, y = next(ToyBatches(np.zeros(0, "<u2"), batch_size=8, seq_len=12, seed=0, vocab_size=50))
    stride = (y - x) % 50
    assert (stride == stride[:, :1]).all() and ((stride >= 1) & (stride <= 4)).all()


def test_toy_data_validates_on_the_same_batches_every_time():
    d = toy_data(parse_args(["--use-toy-data", "--preset", "tiny"]), rank=0, pin=False)
    assert d.vocab_size == 64 and d.train_tokens is None
    assert torch.equal(next(d.make_val())[0], next(d.make_val())[0])
    assert not torch.equal(next(d.make_val())[0], next(d.train)[0])  # another stream


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
        ids_of(f)


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "secret.txt"
    f.write_text("x")
    real = tokens_module.os.open

    def denied(path, flags, *a):
        if str(path) == str(f):
            raise PermissionError(13, "Permission denied")
        return real(path, flags, *a)

    monkeypatch.setattr(tokens_module.os, "open", denied)  # root would read a chmod-0 file anyway
    with pytest.raises(UsageError, match="cannot read .*Permission denied"):
        ids_of(f)


def test_a_directory_without_token_files_is_one_line(tmp_path):
    """A folder is read as llm.c's shards are given: its .bin files. Without any, one line."""
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(UsageError, match="holds no .bin token files; pass --train-data its files"):
        ids_of(tmp_path)


def test_cached_tokens_never_build_the_tokenizer(tmp_path, cache, monkeypatch):
    """The encoder costs about 50 MiB for the whole run: a run whose tokens are cached skips it."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    first = ids_of(text)  # tokenises and writes the cache

    def no_encoder(name="gpt2"):
        raise AssertionError("the encoder was built for cached tokens")

    monkeypatch.setattr(tokens_module, "registry_tokenizer", no_encoder)
    monkeypatch.setattr(data_module, "gpt2_tokenizer", no_encoder)
    again = ids_of(text)
    assert np.array_equal(np.asarray(again), np.asarray(first))


def test_a_path_under_home_reads_the_same_for_every_user(monkeypatch, tmp_path):
    from minigpt.fileio import display_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert display_path(tmp_path / ".cache" / "minigpt" / "x.json") == "~/.cache/minigpt/x.json"
    assert display_path("/elsewhere/x.json") == "/elsewhere/x.json"
