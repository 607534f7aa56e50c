"""The shape of one training step, torch-free: GPTConfig's fields (the vocabulary padded) and the
batch. The memory estimator, the step-time predictor, the parallel planner and the benchmarks
compute from it; the trainer builds its model from the flags themselves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from minigpt.config import pad_vocab, param_count


@dataclass(frozen=True)
class Shape:
    """One training step's shape: GPTConfig's fields (minigpt/core/model.py, the vocabulary padded) and
    the batch: batch_size sequences of seq_len tokens, grad_accum_steps micro-batches a step."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    seq_len: int
    batch_size: int
    vocab_size: int  # padded (pad_vocab)
    max_position_embeddings: int
    dropout: float = 0.0
    activation_checkpoint: bool = False
    chunked_loss: bool = False
    grad_accum_steps: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch (b x s): the rows of every activation and of the logits."""
        return self.batch_size * self.seq_len

    @property
    def params(self) -> int:
        """Every parameter, the tied head once: GPT.num_params(non_embedding=False)."""
        return param_count(
            self.vocab_size, self.max_position_embeddings, self.d_model, self.d_ff, self.n_layers
        )

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matrix products of forward and backward (N without
        the position embedding, which costs no FLOPs), plus 12 * L * d * T for the attention
        scores and their use (PaLM appendix B; nanoGPT's estimate_mfu)."""
        n = self.params - self.max_position_embeddings * self.d_model
        return 6 * n + 12 * self.n_layers * self.d_model * self.seq_len

    def param_sizes(self) -> list[int]:
        """Elements of each parameter tensor (the tied head is the embedding's): what the optimizer
        and the gradient clipping loop over, a tensor at a time."""
        blocks = block_param_sizes(self.d_model, self.d_ff) * self.n_layers
        return [
            self.vocab_size * self.d_model,
            self.max_position_embeddings * self.d_model,
            *blocks,
            self.d_model,
            self.d_model,
        ]

    def model_kwargs(self) -> dict:
        """GPTConfig's arguments: minigpt.core.model.GPT(GPTConfig(**shape.model_kwargs()))."""
        return {k: v for k, v in asdict(self).items() if k not in BATCH_FIELDS}


BATCH_FIELDS = ("seq_len", "batch_size", "grad_accum_steps")  # the rest are GPTConfig's


def block_param_sizes(d_model: int, d_ff: int) -> list[int]:
    """Elements of each parameter tensor of one block, in the module's order: ln_1, qkv, attn.proj,
    ln_2, mlp.fc, mlp.proj (weights, then biases)."""
    h, f = d_model, d_ff
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]


def shape_of(cfg, vocab_size: int, **changes) -> Shape:
    """The step shape of a TrainConfig, or of a preset (a dict of the same names), with the
    vocabulary padded. What parse_args resolves is resolved the same way here for a preset: d_ff
    defaults to 4 x d_model, the positions to seq_len. `changes` override the config's values
    before that (a benchmark's own batch and sequence length)."""
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, default=None: getattr(cfg, k, default)
    names = ("n_layers", "d_model", "n_heads", "d_ff", "seq_len", "batch_size", "max_position_embeddings")
    v = {k: get(k) for k in names}
    v.update(
        dropout=get("dropout", 0.0),
        activation_checkpoint=bool(get("use_activation_checkpoint", False)),
        chunked_loss=bool(get("chunked_loss", False)),
        grad_accum_steps=get("grad_accum_steps", 1),
    )
    v.update(changes)
    v["d_ff"] = v["d_ff"] or 4 * v["d_model"]
    v["max_position_embeddings"] = v["max_position_embeddings"] or v["seq_len"]
    return Shape(**v, vocab_size=pad_vocab(vocab_size))
