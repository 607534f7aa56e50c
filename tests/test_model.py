import math

import pytest
import torch

from minigpt.config import pad_vocab
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.shape import Shape


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=128, max_position_embeddings=32, n_layers=2, n_heads=2, d_model=32, d_ff=64)
    return GPT(GPTConfig(**{**cfg, **kw}))


def test_changing_a_future_token_changes_no_earlier_logit():
    model = tiny().eval()
    x = torch.randint(0, 128, (2, 16))
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 128
    a, _ = model(x)
    b, _ = model(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_activation_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 128, (2, 16))
    grads = []
    for ckpt in (False, True):
        model = tiny(activation_checkpoint=ckpt).train()
        model(x, x)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_head_is_tied_and_vocab_padded():
    assert pad_vocab(50257) == 50304 and pad_vocab(64) == 64
    model = tiny()
    assert model.lm_head.weight is model.wte.weight


def test_gpt2_initialisation_scales_residual_projections():
    model = tiny(n_layers=8, d_model=256, d_ff=1024)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_flops_per_token_counts_gpt2_small():
    # GPT-2 small: 124.4M parameters with the 1024 x 768 position table, 123.6M without.
    model = GPT(GPTConfig(vocab_size=50304))
    n = model.num_params(non_embedding=True)
    assert n == model.num_params(non_embedding=False) - 1024 * 768
    shape = Shape(
        12, 768, 12, 3072, seq_len=1024, batch_size=8, vocab_size=50304, max_position_embeddings=1024
    )
    assert shape.flops_per_token == 6 * n + 12 * 12 * 768 * 1024  # the one formula: minigpt/core/shape.py
    assert 123e6 < n < 125e6
