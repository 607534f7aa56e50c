"""sample.py: text (or a toy run's token ids) from a tiny trained checkpoint."""

import runpy
from pathlib import Path

import pytest
import torch
from conftest import TINY

import train_minimal
from minigpt.sample import generate, load_model

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
    assert torch.equal(generate(model, idx, 6, temperature=0.7, top_k=1, generator=gen), ids)


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
    ],
)
def test_bad_inputs_exit_2_with_one_line(toy_run, capsys, flags, expect):
    status, _, err = sample(capsys, "--out-dir", str(toy_run), *flags)
    assert status == 2 and len(err.strip().splitlines()) == 1 and expect in err, err


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
