"""sample.py: text (or a toy run's token ids) from a tiny trained checkpoint."""

import json
import math
import os
import runpy
from pathlib import Path

import pytest
import torch
from conftest import TINY, bench_module

import train_minimal
from minigpt.core.checkpoint import save_checkpoint
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.sample import Draw, KVCache, generate, load_model

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


def test_a_draw_keeps_to_the_top_k_and_the_tokenizers_ids():
    """next_token draws among the top_k likeliest ids only, never an id of the embedding's padding
    (>= vocab_size), as often as their softmax says."""
    logits = torch.full((2, 64), -5.0)
    logits[:, 60:] = 50.0  # padding: never drawn, however likely
    logits[0, [3, 7, 9]] = torch.tensor([2.0, 1.0, 0.0])
    logits[1, 5] = 9.0
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([Draw(1.0, 2, 60).next_token(logits, gen) for _ in range(2000)], dim=1)
    assert set(draws[0].tolist()) == {3, 7} and set(draws[1].tolist()) == {5}
    share = (draws[0] == 3).float().mean().item()  # softmax([2, 1]): 0.731
    assert abs(share - math.exp(1) / (math.exp(1) + 1)) < 0.05
    every = Draw(1.0, None, 60).next_token(logits, gen)
    assert every.shape == (2, 1) and (every < 60).all()


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
        (lambda s: s["config"].update(dropout=2), "dropout holds 2, not a probability"),
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


# ---------------------------------------------------------------------------- the KV cache


def random_gpt(positions: int = 16, vocab: int = 96, seed: int = 0) -> GPT:
    """A small GPT with random weights, its biases and LayerNorms moved off 0 and 1 (so a module
    the cache skipped or used twice shows), in eval mode, fp32."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab, positions, n_layers=3, n_heads=2, d_model=32, d_ff=80)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def greedy_without_cache(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The plain loop: the model's own forward over the whole cropped context for every token."""
    context = model.cfg.max_position_embeddings
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -context:])
            idx = torch.cat([idx, logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize(
    "prompt_len, new",
    [(1, 1), (1, 15), (5, 11), (7, 30), (16, 4), (40, 25)],  # the window (16) filled, passed, slid
)
def test_cached_greedy_decoding_is_the_full_context_argmax(prompt_len, new):
    model = random_gpt()
    gen = torch.Generator().manual_seed(prompt_len)
    for rows in (1, 3):
        idx = torch.randint(0, 96, (rows, prompt_len), generator=gen)
        cached = generate(model, idx, new, Draw(temperature=0.9, top_k=1), generator=gen)
        assert torch.equal(cached, greedy_without_cache(model, idx, new)), (rows, prompt_len, new)


def test_cached_logits_are_the_models_at_every_position():
    model = random_gpt()
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)[0]
    for split in (1, 6, 16):  # a prefill of `split` tokens, then one token at a time
        cache = KVCache(model)
        parts = [cache.forward(x[:, :split], all_logits=True)]
        parts += [cache.forward(x[:, i : i + 1]) for i in range(split, 16)]
        assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0), split
    assert KVCache(model).head.is_contiguous() and KVCache(model).head.shape == (model.cfg.d_model, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the copy in autocast's dtype: cast once, not a token
        cache, full_bf16 = KVCache(model), model(x)[0]
        assert cache.head.dtype == torch.bfloat16
        assert torch.allclose(cache.forward(x, all_logits=True).float(), full_bf16.float(), atol=0.05, rtol=0)
    cache = KVCache(model)  # several tokens after kept ones: each sees only those before it
    parts = [cache.forward(x[:, :5], all_logits=True), cache.forward(x[:, 5:], all_logits=True)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    cache.reset()  # the window slid: the cropped context prefilled again, positions from 0
    assert torch.allclose(cache.forward(x[:, 3:], all_logits=True), model(x[:, 3:])[0], atol=1e-5, rtol=0)
    cache.forward(x[:, :3])  # 16 positions taken
    with pytest.raises(ValueError, match="16 positions"):
        cache.forward(x[:, :1])  # past the position table: the caller crops and resets


# ---------------------------------------------------------------------------- --init-from DIR


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny GPT-2 saved by Transformers itself (offline: no download), and the model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=50257)
    model = GPT2LMHeadModel(GPT2Config(**shape)).eval()
    with torch.no_grad():  # away from 0 and 1, so that a mix-up shows
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model.save_pretrained(path)
    return path, model


def test_init_from_folder_samples_what_transformers_generates(hf_folder, capsys):
    from minigpt.core.data import gpt2_tokenizer

    folder, hf = hf_folder
    enc = gpt2_tokenizer()
    for prompt, new in (("The while statement", 20), ("Hello", 40)):
        ids = enc.encode_ordinary(prompt)
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                min_new_tokens=new,  # no stop at <|endoftext|>: the same length as sample.py's
                do_sample=False,
                pad_token_id=50256,
            )[0].tolist()
        assert len(theirs) == len(ids) + new
        flags = ("--init-from", str(folder), "--prompt", prompt, "--top-k", "1", "--num-samples", "1")
        status, out, err = sample(capsys, *flags, "--max-new-tokens", str(new), "--device", "cpu")
        assert status == 0, err
        assert out.rstrip("\n") == SAMPLE["sample_text"](theirs, toy=False, from_document_start=False)
        assert f"loaded {folder}" in err


def test_bad_init_from_folders_are_one_line(hf_folder, tmp_path, capsys):
    folder, _ = hf_folder
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "bert"}')
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((folder / "config.json").read_bytes())
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # nothing ever writes to it: reading it would block for ever
    for path, expect in (
        (fifo, "config.json is a FIFO, not a regular file"),
        (tmp_path / "nope", "no such folder"),
        (tmp_path, "no config.json"),
        (other, "not GPT-2"),
        (no_weights, "no model.safetensors"),
    ):
        status, _, err = sample(capsys, "--init-from", str(path), "--max-new-tokens", "1")
        assert status == 2 and len(err.strip().splitlines()) == 1 and expect in err, err
    with pytest.raises(SystemExit) as exit_:  # one source at a time
        SAMPLE["cli"](["--init-from", str(folder), "--checkpoint", "x.pt"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # Path("") would be the current folder
        SAMPLE["cli"](["--init-from", ""])
    assert exit_.value.code == 2 and "--init-from: is empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------- sample.py's own words


def test_a_file_that_is_no_checkpoint_gets_sample_py_advice(tmp_path, capsys):
    not_one = tmp_path / "README.md"
    not_one.write_text("# not a checkpoint\n")
    status, _, err = sample(capsys, "--checkpoint", str(not_one))
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "not a checkpoint" in err and "--checkpoint" in err and "--resume" not in err, err


def test_a_folder_or_nothing_given_to_checkpoint_names_sample_py_flags(tmp_path, toy_run, capsys):
    for path, expect in (
        (tmp_path, "is a folder, not a checkpoint file"),
        (toy_run, f"pass it as --out-dir {toy_run}"),
        (tmp_path / "nope.pt", "no such file"),
    ):
        status, _, err = sample(capsys, "--checkpoint", str(path))
        assert status == 2 and len(err.strip().splitlines()) == 1 and expect in err, err
        assert "--checkpoint-path" not in err and "--resume" not in err, err
        assert f"--checkpoint {path}" in err, err


# ---------------------------------------------------------------------------- benchmarks/sample_speed.py


def test_sample_speed_benchmark_writes_its_table_and_keeps_what_is_there(tmp_path, capsys):
    speed = bench_module("sample_speed")
    args = ["--preset", "tiny", "--tokens", "2", "--rounds", "3", "--out-dir", str(tmp_path)]
    assert speed.main(args) == 0
    data = json.loads((tmp_path / "sample-speed.json").read_text())
    table = (tmp_path / "sample-speed.md").read_text()
    assert set(data["results"]) == {speed.WITH, speed.WITHOUT, speed.BEFORE, speed.LINEAR_HEAD}
    assert all(len(r["rounds"]) == 3 for r in data["results"].values())
    assert data["speedup"]["n_a"] == data["speedup"]["n_b"] == data["speedup_before"]["n_a"] == 3
    assert data["speedup_head"]["n_a"] == 3 and "the head's (d_model, vocab) copy" in table.lower()
    from minigpt.core import sample

    assert sample.KVCache.__name__ == "KVCache"  # the stored-head variant put the class back
    meta = data["meta"]
    assert meta["model"]["weights"].startswith("random") and meta["machine"]["device"] == "cpu"
    assert {"load_start", "load_end", "busy_run", "aa"} <= meta.keys()
    assert "Speed-up with the cache" in table and "Load average" in table and "random" in table
    assert "sample.py against what it ran before" in table
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # results already there: kept, one line
        speed.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "--force" in err, err
    for bad in (["--tokens", "0"], ["--rounds", "-1"], ["--preset", "huge"]):
        with pytest.raises(SystemExit) as exit_:
            speed.main([*bad, "--out-dir", str(tmp_path / "other")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "other").exists()
