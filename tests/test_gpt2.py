"""GPT-2 in and out (minigpt/core/gpt2.py), held against Hugging Face Transformers itself, offline:
every model here is built by the test (no download). Both ways, the logits on the same ids agree
within 1e-4 in fp32; the tokenizer an export writes gives the trainer's ids."""

import os
import pickle

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder only: never the network

import pytest
import torch
from conftest import fails
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

import train_minimal
from minigpt.config import GPT2_VOCAB, parse_args
from minigpt.core import gpt2
from minigpt.core.gpt2 import load_pretrained
from minigpt.core.model import GPT, GPTConfig
from minigpt.errors import UsageError

SHAPE = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=GPT2_VOCAB)
# The tiny preset's shape is the folder's; the built-in corpus, GPT-2's ids.
RUN = ["--preset", "tiny", "--num-steps", "2", "--eval-iters", "1", "--no-report", "--device", "cpu"]


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**SHAPE)).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0 and 1, so a mix-up shows
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def folder(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    hf_model.save_pretrained(path)
    return path


def ids(n: int = 48) -> torch.Tensor:
    return torch.randint(0, GPT2_VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def minigpt_logits(model: GPT, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)[0][..., :GPT2_VOCAB]  # the padded ids cut off


def hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x).logits


def small_cfg(**changes) -> GPTConfig:
    """What the page's flags make before the folder is read (the tiny preset, GPT-2's vocabulary)."""
    tiny = dict(vocab_size=50304, max_position_embeddings=64, n_layers=2, n_heads=2)
    return GPTConfig(**{**tiny, **changes})


# ---------------------------------------------------------------------------- in


def test_import_gives_transformers_logits(folder, hf_model):
    model = load_pretrained(folder, small_cfg(n_layers=4, d_model=256, d_ff=1024, dropout=0.1))
    c = model.cfg
    assert (c.vocab_size, c.max_position_embeddings, c.n_layers, c.n_heads, c.d_model, c.d_ff) == (
        50304, 64, 2, 2, 64, 256,
    )  # fmt: skip
    assert c.dropout == 0.1  # the user's, not the folder's
    assert model.wte.weight[GPT2_VOCAB:].abs().sum() == 0  # the pad rows zero
    assert model.lm_head.weight is model.wte.weight  # still tied
    x = ids()
    assert (minigpt_logits(model, x) - hf_logits(hf_model, x)).abs().max() < 1e-4


def test_import_reads_the_hubs_own_layout(folder, hf_model, tmp_path):
    """OpenAI's gpt2 on the hub: names without `transformer.`, the causal masks saved beside the
    weights, the tied head stored too; here as a weights-only pytorch_model.bin."""
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items()}
    for i in range(SHAPE["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_bytes((folder / "config.json").read_bytes())
    torch.save(sd, hub / "pytorch_model.bin")
    x = ids()
    assert (minigpt_logits(load_pretrained(hub, small_cfg()), x) - hf_logits(hf_model, x)).abs().max() < 1e-4


def test_init_from_fine_tunes_from_the_folder(folder, hf_model, tmp_path, monkeypatch):
    """The page loads the folder: before step 1 the model holds the folder's weights, and the
    checkpoint after 2 steps differs from them (it trained)."""
    loaded = []
    monkeypatch.setattr(gpt2, "load_pretrained", lambda *a: loaded.append(load_pretrained(*a)) or loaded[-1])
    theirs = {k: v.clone() for k, v in hf_model.state_dict().items()}

    def on_step(n):
        if n == 1:
            ours = loaded[0].state_dict()
            for name, their_name, conv in gpt2.names(2):
                t = theirs["transformer." + their_name]
                mine = ours[name][:GPT2_VOCAB] if name == "wte.weight" else ours[name]
                assert torch.equal(mine, t.T if conv else t), name

    out = tmp_path / "run"
    assert train_minimal.cli([*RUN, "--init-from", str(folder), "--out-dir", str(out)], on_step=on_step) == 0
    assert len(loaded) == 1
    assert f"Starting from {folder}'s weights" in (out / "train.log").read_text()  # not "afresh"
    trained = torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)["model"]["wpe.weight"]
    assert not torch.equal(trained, theirs["transformer.wpe.weight"])


def test_a_shape_flag_that_disagrees_is_refused(folder):
    cfg = parse_args([*RUN, "--n-layers", "3", "--init-from", str(folder)])
    with pytest.raises(UsageError, match=r"--n-layers 3 disagrees with .*'s n_layer 2"):
        load_pretrained(folder, small_cfg(n_layers=3), cfg)
    cfg = parse_args([*RUN, "--init-from", str(folder)])  # the preset's shape is not a flag given
    model = load_pretrained(folder, small_cfg(n_layers=5), cfg)
    assert model.cfg.n_layers == cfg.n_layers == 2  # the run's figures describe the folder's model


def test_the_page_refuses_a_shape_flag(folder, tmp_path, capsys):
    flags = [*RUN, "--d-model", "128", "--init-from", str(folder), "--out-dir", str(tmp_path / "run")]
    assert "--d-model 128 disagrees" in fails(capsys, *flags)


def test_a_sequence_longer_than_the_folders_positions_is_refused(folder, tmp_path, capsys):
    flags = [*RUN, "--seq-len", "128", "--init-from", str(folder), "--out-dir", str(tmp_path / "run")]
    line = fails(capsys, *flags)
    assert "--seq-len" in line and "n_positions 64" in line


def copy_of(folder, tmp_path, name="copy"):
    path = tmp_path / name
    path.mkdir()
    for f in folder.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def edit_config(path, **changes):
    import json

    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_another_architecture_is_refused(folder, tmp_path, capsys):
    other = copy_of(folder, tmp_path)
    edit_config(other, model_type="llama")
    flags = [*RUN, "--init-from", str(other), "--out-dir", str(tmp_path / "run")]
    assert "holds a llama, not GPT-2" in fails(capsys, *flags)
    edit_config(other, model_type="gpt2", activation_function="relu")
    with pytest.raises(UsageError, match="activation_function 'relu'"):
        load_pretrained(other, small_cfg())


def test_weights_that_do_not_match_the_config_are_refused(folder, hf_model, tmp_path):
    from safetensors.torch import save_file

    more = copy_of(folder, tmp_path, "more")
    edit_config(more, n_layer=3)
    with pytest.raises(UsageError, match=r"its weights hold 2 blocks, its config's n_layer 3"):
        load_pretrained(more, small_cfg())
    # a tensor gone from one block: named
    sd = {
        k: v.clone()
        for k, v in hf_model.state_dict().items()
        if k not in ("lm_head.weight", "transformer.h.1.ln_2.bias")
    }
    save_file(sd, more / "model.safetensors")
    edit_config(more, n_layer=2)
    with pytest.raises(UsageError, match=r"lack h\.1\.ln_2\.bias \(1 missing\)"):
        load_pretrained(more, small_cfg())
    wider = copy_of(folder, tmp_path, "wider")
    edit_config(wider, n_inner=512)
    with pytest.raises(UsageError, match=r"c_fc\.weight has shape \(64, 256\), expected \(64, 512\)"):
        load_pretrained(wider, small_cfg())
    extra = copy_of(folder, tmp_path, "extra")
    sd = {k: v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file({**sd, "transformer.h.0.attn.q_norm.weight": torch.ones(64)}, extra / "model.safetensors")
    with pytest.raises(UsageError, match="hold h.0.attn.q_norm.weight, which its config has no place for"):
        load_pretrained(extra, small_cfg())
    (extra / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json}")
    with pytest.raises(UsageError, match="damaged or not safetensors"):
        load_pretrained(extra, small_cfg())
    (extra / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="no model.safetensors"):
        load_pretrained(extra, small_cfg())
    (extra / "config.json").unlink()
    with pytest.raises(UsageError, match="no config.json"):
        load_pretrained(extra, small_cfg())


def test_a_config_is_checked_against_the_weights_before_anything_is_built(folder, tmp_path):
    """A config.json of a billion positions, or far wider than its weights, is one line naming the
    tensor, not an allocation of hundreds of gigabytes; a FIFO config is refused, not waited on."""
    far = copy_of(folder, tmp_path, "far")
    edit_config(far, n_positions=10**9)
    with pytest.raises(UsageError, match=r"wpe\.weight has shape \(64, 64\), expected \(1000000000, 64\)"):
        load_pretrained(far, small_cfg())
    edit_config(far, n_positions=64, n_embd=2**20, n_head=1)
    with pytest.raises(UsageError, match=r"wte\.weight has shape \(50257, 64\), expected \(50257, 1048576\)"):
        load_pretrained(far, small_cfg())
    edit_config(far, n_embd=64, n_head=2, n_layer=10**9)
    with pytest.raises(UsageError, match="hold 2 blocks, its config's n_layer 1000000000"):
        load_pretrained(far, small_cfg())
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    with pytest.raises(UsageError, match="config.json is a FIFO, not a regular file"):
        load_pretrained(fifo, small_cfg())
    (far / "config.json").write_text("[" * 200_000)  # nested past Python's stack: json's RecursionError
    with pytest.raises(UsageError, match=r"does not read as JSON \(RecursionError\)"):
        load_pretrained(far, small_cfg())


def test_a_folder_whose_vocabulary_is_below_the_datas_is_refused(tmp_path):
    """50,250 ids pad to the same 50,304 rows as GPT-2's 50,257: the check is on the ids, not the rows."""
    short = tmp_path / "short"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**{**SHAPE, "vocab_size": 50250})).save_pretrained(short)
    with pytest.raises(UsageError, match=r"a vocabulary of 50,257\) do not fit .*vocab_size 50,250"):
        load_pretrained(short, small_cfg())  # GPT-2's ids, the default


def test_toy_data_from_a_folder_counts_the_folders_vocabulary(folder, run, tmp_path):
    """--use-toy-data uses 64 of a GPT-2 folder's ids, but the head computes all 50,304 rows: the
    FLOPs (and MFU) are the model's, the same as a text run of the same shape."""
    import json

    out = tmp_path / "toy"
    assert train_minimal.cli([*RUN, "--use-toy-data", "--init-from", str(folder), "--out-dir", str(out)]) == 0
    toy, text = (json.loads((d / "config.json").read_text()) for d in (out, run))
    assert toy["flops_per_token"] == text["flops_per_token"] > 0


class Payload:
    """A pickle that runs code when read: what weights_only=True never unpickles."""

    def __reduce__(self):
        return (os.mkdir, (os.environ["GPT2_TEST_MARKER"],))


def test_a_pickled_bin_that_is_not_weights_only_is_refused(folder, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("GPT2_TEST_MARKER", str(marker))
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_bytes((folder / "config.json").read_bytes())
    for save in (torch.save, lambda obj, path: path.write_bytes(pickle.dumps(obj))):  # zip, a bare pickle
        save({"wte.weight": Payload()}, evil / "pytorch_model.bin")
        with pytest.raises(UsageError, match="a pickle that holds more than weights"):
            load_pretrained(evil, small_cfg())
        assert not marker.exists()


# ---------------------------------------------------------------------------- out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A minigpt run of 2 steps on the built-in corpus (GPT-2's ids), its checkpoint written."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert train_minimal.cli([*RUN, "--out-dir", str(out)]) == 0
    return out


def test_export_loads_in_transformers(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert gpt2.main([str(run), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
         "special_tokens_map.json"]
    )  # fmt: skip
    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.vocab_size == GPT2_VOCAB  # the padding cut off
    state = torch.load(run / "checkpoints" / "ckpt.pt", weights_only=True)
    ours = GPT(GPTConfig(**state["model_config"]))
    ours.load_state_dict(state["model"])
    x = ids()
    assert (minigpt_logits(ours, x) - hf_logits(hf, x)).abs().max() < 1e-4

    from minigpt.core.data import gpt2_tokenizer

    text = "Hello, world! It's 2024 — déjà vu:\n\tindented   spaces<|endoftext|> and code: x = f(y) + 1"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(text)["input_ids"] == gpt2_tokenizer().encode(text, allowed_special="all")
    assert tokenizer.eos_token_id == 50256


def test_export_of_a_checkpoint_file_and_a_toy_run(tmp_path):
    toy = tmp_path / "toy"
    flags = ["--use-toy-data", *RUN, "--out-dir", str(toy)]
    assert train_minimal.cli(flags) == 0
    out = tmp_path / "hf"
    assert gpt2.main([str(toy / "checkpoints" / "ckpt.pt"), "--out", str(out)]) == 0
    assert not (out / "vocab.json").exists()  # toy ids are no one's text: no tokenizer
    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.vocab_size == 64  # the toy vocabulary, its own
    state = torch.load(toy / "checkpoints" / "ckpt.pt", weights_only=True)
    ours = GPT(GPTConfig(**state["model_config"]))
    ours.load_state_dict(state["model"])
    x = torch.randint(0, 64, (2, 64))
    with torch.no_grad():
        assert (ours.eval()(x)[0] - hf_logits(hf, x)).abs().max() < 1e-4


def test_export_writes_nothing_outside_out_and_needs_force(run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert gpt2.main([str(run), "--out", str(out)]) == 2
    assert "exists; add --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["README.md"]  # nothing written
    assert gpt2.main([str(run), "--out", str(out), "--force"]) == 0
    assert (out / "README.md").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # the run untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_never_replaces_a_runs_record_nor_half_writes(run, tmp_path, capsys):
    """--force replaces the files export writes, not a run's own config.json (its record), and a
    name export writes that is a folder there stops it before the first file."""
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "config.json").write_bytes((run / "config.json").read_bytes())
    assert gpt2.main([str(run), "--out", str(copy), "--force"]) == 2
    assert "config.json that is not a Hugging Face one" in capsys.readouterr().err
    assert (copy / "config.json").read_bytes() == (run / "config.json").read_bytes()
    assert sorted(p.name for p in copy.iterdir()) == ["config.json"]
    (copy / "config.json").write_text("[" * 200_000)  # no config json reads: not replaced either
    assert gpt2.main([str(run), "--out", str(copy), "--force"]) == 2
    assert "config.json that is not a Hugging Face one" in capsys.readouterr().err
    part = tmp_path / "part"
    (part / "vocab.json").mkdir(parents=True)
    assert gpt2.main([str(run), "--out", str(part), "--force"]) == 2
    assert "its vocab.json is not a file" in capsys.readouterr().err
    assert [p.name for p in part.iterdir()] == ["vocab.json"]


@pytest.mark.parametrize(
    "edit, expected",
    [(lambda s: s["model_config"].update(n_layers=1), "hold 2 blocks, its model_config says n_layers 1"),
     (lambda s: s["model_config"].update(n_heads=3), "n_heads 3, which does not divide d_model"),
     (lambda s: s["model"].update({"blocks.0.mlp.fc.weight": torch.zeros(100, 64)}), "has shape [100, 64]"),
     (lambda s: s["config"].update(dropout="x"), "dropout holds 'x'")],
)  # fmt: skip
def test_export_checks_the_weights_against_the_shape_they_claim(edit, expected, run, tmp_path, capsys):
    from minigpt.core.checkpoint import save_checkpoint

    state = torch.load(run / "checkpoints" / "ckpt.pt", weights_only=True)
    edit(state)
    save_checkpoint(tmp_path / "edited.pt", state)  # its checksum made anew: the field is what is tested
    assert gpt2.main([str(tmp_path / "edited.pt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "source, expected",
    [("missing", "no such run folder or checkpoint"), ("empty", "holds no checkpoint"),
     ("garbage.pt", "or export another run")],
)  # fmt: skip
def test_export_refuses_bad_input_in_one_line(source, expected, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    assert gpt2.main([str(tmp_path / source), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv", [["", "--out", "hf"], ["run", "--out", ""]])
def test_export_refuses_an_empty_path(argv, capsys):
    """Path("") is the current folder: an empty --out would write six files where the user stands."""
    with pytest.raises(SystemExit) as exit_:
        gpt2.main(argv)
    assert exit_.value.code == 2 and "is empty; name a path" in capsys.readouterr().err
