"""sample.py: text (or a toy run's token ids) from a tiny trained checkpoint."""

import os
import runpy
from pathlib import Path

import pytest
import torch
from conftest import TINY

import train_minimal
from minigpt.core.checkpoint import save_checkpoint
from minigpt.core.sample import Draw, generate, load_model

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = runpy.run_path(str(ROOT / "sample.py"))  # the script's functions, without running it


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "toy"
    assert train_minimal.cli([*TINY, "--num-steps", "6", "--log-interval", "3", "--out-dir", str(out)]) == 0
    return out


def sample(capsys, *args: str) -> tuple[int, str, str]:
    status = SAMPLE["cli"](list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def rows(stdout: str) -> list[list[int]]:
    return [[int(t) for t in block.split()] for block in stdout.split(SAMPLE["SEPARATOR"])]


def test_same_seed_same_samples_and_the_right_length(toy_run, capsys):
    args = (
        "--out-dir",
        str(toy_run),
        "--prompt",
        "1 2 3",
        "--num-samples",
        "3",
        "--max-new-tokens",
        "7",
        "--temperature",
        "1.5",
        "--seed",
        "5",
    )
    status, first, _ = sample(capsys, *args)
    assert status == 0
    assert sample(capsys, *args)[1] == first
    out = rows(first)
    assert len(out) == 3 and all(len(r) == 3 + 7 and r[:3] == [1, 2, 3] for r in out)
    assert all(0 <= t < 64 for r in out for t in r)  # the toy vocabulary, not its padding


def test_top_k_1_is_greedy_decoding(toy_run):
    model, _ = load_model(toy_run / "checkpoints" / "ckpt.pt")
    idx = torch.tensor([[4, 6, 8], [1, 2, 3]])
    ids = idx.clone()
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model(ids[:, -model.cfg.max_position_embeddings :])
            ids = torch.cat([ids, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(generate(model, idx, 6, Draw(temperature=0.7, top_k=1), generator=gen), ids)


def test_context_is_cropped_to_the_position_table(toy_run):
    model, _ = load_model(toy_run / "checkpoints" / "ckpt.pt")
    long_prompt = torch.arange(3 * model.cfg.max_position_embeddings).remainder(64).unsqueeze(0)
    out = generate(model, long_prompt, 4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, long_prompt.size(1) + 4)


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-k", "0"], "--top-k"),
        (["--prompt", "1 99999"], "outside this model's vocabulary"),
        (["--prompt", "hello"], "token ids"),
        (["--seed", "-1"], "--seed"),
        (["--prompt", "FILE:/nonexistent/prompt.txt"], "cannot read"),
        (["--prompt", "FILE:/dev/zero"], "not a regular file"),
        (["--temperature", "1e-300"], "--top-k 1"),
        (["--num-samples", "100000000000"], "at most 10,000 samples"),
        (["--max-new-tokens", "99999999999999"], "at most 100,000 tokens"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(toy_run, capsys, flags, expect):
    status, _, err = sample(capsys, "--out-dir", str(toy_run), *flags)
    assert status == 2 and len(err.strip().splitlines()) == 1 and expect in err, err


def test_a_fifo_prompt_is_refused_not_waited_on(toy_run, tmp_path, capsys):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)  # nothing ever writes to it: reading it would block for ever
    status, _, err = sample(capsys, "--out-dir", str(toy_run), "--prompt", f"FILE:{fifo}")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "is a FIFO" in err, err


def edited(toy_run: Path, tmp_path: Path, edit) -> Path:
    state = torch.load(toy_run / "checkpoints" / "ckpt.pt", weights_only=True)
    edit(state)
    path = tmp_path / "edited.pt"
    save_checkpoint(path, state)  # with its checksum made anew: what is tested is the edited field
    return path


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda s: s["model_config"].update(n_heads=3), "n_heads 3, which does not divide d_model"),
        (lambda s: s["config"].update(vocab_size="64"), "vocab_size holds '64'"),
        (lambda s: s["config"].update(use_toy_data="yes"), "use_toy_data holds 'yes'"),
        (lambda s: s["config"].update(use_toy_data=False), "tokenizer's 50257 ids do not fit"),
        (lambda s: s["config"].update(vocab_size=10**12), "does not fit its model's embedding"),
        (lambda s: s["config"].update(use_toy_data=False, tokenizer_name=5), "tokenizer_name holds 5"),
        (
            lambda s: s["config"].update(use_toy_data=False, tokenizer_name="nosuch"),
            "'nosuch' is not available",
        ),
    ],
)
def test_a_hand_edited_checkpoint_config_is_one_line(toy_run, tmp_path, capsys, edit, expect):
    path = edited(toy_run, tmp_path, edit)
    status, _, err = sample(capsys, "--checkpoint", str(path), "--max-new-tokens", "2")
    assert status == 2 and len(err.strip().splitlines()) == 1 and expect in err, err


def test_no_runs_names_sample_flags_not_the_trainers(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # runs/ is relative: here there is none
    (tmp_path / "runs").mkdir()
    status, _, err = sample(capsys)
    assert status == 2 and "pass --out-dir or --checkpoint" in err and "--checkpoint-path" not in err, err


def test_missing_or_wrong_checkpoints_exit_2(tmp_path, toy_run, capsys):
    for args in (
        ["--out-dir", str(tmp_path / "nope")],
        ["--out-dir", str(tmp_path)],
        ["--checkpoint", str(toy_run)],
        ["--checkpoint", str(toy_run / "config.json")],
    ):
        status, _, err = sample(capsys, *args)
        assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_text_run_decodes_with_the_gpt2_tokenizer(tmp_path, capsys):
    import pydoc_data.topics

    text = tmp_path / "train.txt"
    text.write_text(pydoc_data.topics.topics["while"] * 4)
    out = tmp_path / "text"
    flags = [f for f in TINY if f != "--use-toy-data"]
    status = train_minimal.cli([*flags, "--train-data", str(text), "--num-steps", "2", "--out-dir", str(out)])
    assert status == 0
    capsys.readouterr()
    status, stdout, _ = sample(
        capsys,
        "--out-dir",
        str(out),
        "--prompt",
        "The while statement",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "5",
    )
    assert status == 0
    blocks = stdout.split(SAMPLE["SEPARATOR"])
    assert len(blocks) == 2 and all(b.strip().startswith("The while statement") for b in blocks)


def test_status_goes_to_stderr_and_only_the_samples_to_stdout(toy_run, capsys):
    """A long sampling run says what it is doing (it once printed nothing for minutes)."""
    status, out, err = sample(
        capsys, "--out-dir", str(toy_run), "--num-samples", "3", "--max-new-tokens", "4"
    )
    assert status == 0
    assert f"loaded {toy_run / 'checkpoints' / 'ckpt.pt'}" in err
    for i in (1, 2, 3):
        assert f"generating sample {i} of 3" in err
    assert len(rows(out)) == 3  # stdout parses as the samples alone


def test_generate_reports_every_new_token(toy_run):
    model, _ = load_model(toy_run / "checkpoints" / "ckpt.pt")
    ticks = []
    generate(
        model,
        torch.tensor([[1, 2]]),
        5,
        generator=torch.Generator().manual_seed(0),
        on_token=lambda: ticks.append(1),
    )
    assert len(ticks) == 5


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        SAMPLE["parse_args"](["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split("options:")[1].split())  # argparse wraps lines
    for flag, default in {
        "--num-samples": 3,
        "--max-new-tokens": 200,
        "--temperature": 0.8,
        "--top-k": 200,
        "--seed": 1337,
        "--device": "auto",
        "--dtype": "fp32",
    }.items():
        assert f"(default: {default})" in text.split(flag, 1)[1].split(" --")[0], flag
    assert "the run in runs/ whose checkpoint is newest" in text and "default '0 2 4 6'" in text
    assert "(default: None)" not in text


TEXT = "日本語の文章 🙂👍 naïve café"  # CJK, emoji, accents: GPT-2 splits their bytes over tokens


def test_characters_split_over_tokens_decode_whole():
    """GPT-2's byte-level tokens split a CJK character or an emoji over two or three tokens; the
    sample's text must show the character, never U+FFFD for its halves."""
    from minigpt.config import EOT
    from minigpt.core.data import gpt2_tokenizer

    enc = gpt2_tokenizer()
    tokens = enc.encode_ordinary(TEXT)
    pieces = [enc.decode_single_token_bytes(t) for t in tokens]
    split = []
    for p in pieces:
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            split.append(p)
    assert split, "the text must hold tokens that are part of a character, or this test proves nothing"
    text = SAMPLE["sample_text"]([EOT, *tokens], toy=False, from_document_start=True)
    assert text == TEXT and "\ufffd" not in text


def test_a_sample_cut_inside_a_character_leaves_the_partial_character_out():
    """max_new_tokens can end a sample between the tokens of one character: the complete text up to
    it is shown, not a trailing U+FFFD."""
    from minigpt.core.data import gpt2_tokenizer

    enc = gpt2_tokenizer()
    tokens = enc.encode_ordinary(TEXT)
    cuts = 0
    for k in range(1, len(tokens)):
        data = enc.decode_bytes(tokens[:k])
        text = SAMPLE["sample_text"](tokens[:k], toy=False, from_document_start=False)
        assert "\ufffd" not in text and TEXT.startswith(text), k
        complete = data.decode("utf-8", errors="ignore")
        assert text == complete
        cuts += enc.decode(tokens[:k]).endswith("\ufffd")  # what decoding without care shows
    assert cuts > 0  # some cut falls inside a character


def test_bytes_that_are_not_utf8_still_show_as_replacement():
    """A lone continuation byte (an undertrained model draws them) is no character at all: it shows
    as U+FFFD, in the middle; only a character cut at the end is held back."""
    from minigpt.core.sample import utf8_text

    assert utf8_text(b"a\x80b") == "a\ufffdb"
    assert utf8_text("é".encode() + "🙂".encode()[:2]) == "é"
