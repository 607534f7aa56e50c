"""--chunked-loss: the LM head and the cross-entropy over chunks of rows give the plain path's loss
(F.cross_entropy's) and gradients (the tied weight's included), and a lower measured peak."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from minigpt.core import chunked_loss
from minigpt.core.chunked_loss import ChunkedCrossEntropy
from minigpt.core.model import GPT, GPTConfig
from minigpt.instruments.breakdown import capture_memory


def make(chunked: bool, vocab=256):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=vocab,
            max_position_embeddings=16,
            n_layers=2,
            n_heads=2,
            d_model=32,
            d_ff=64,
            chunked_loss=chunked,
        )
    )


def loss_and_grads(chunked: bool, amp: bool, x, y):
    m = make(chunked)
    with torch.autocast("cpu", dtype=torch.bfloat16) if amp else nullcontext():
        logits, loss = m(x, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("amp,tol", [(False, 1e-5), (True, 2e-2)])
def test_loss_and_gradients_equal_the_plain_path(amp, tol, monkeypatch):
    monkeypatch.setattr(
        chunked_loss, "LOSS_CHUNK_ELEMENTS", 256 * 7
    )  # 7 rows a chunk: several chunks, a ragged end
    torch.manual_seed(1)
    x = torch.randint(0, 256, (3, 16))
    y = torch.roll(x, -1, 1)
    plain_logits, plain, plain_grads = loss_and_grads(False, amp, x, y)
    chunked_logits, chunked, chunked_grads = loss_and_grads(True, amp, x, y)
    assert chunked_logits is None and plain_logits is not None
    assert torch.allclose(chunked, plain, rtol=tol, atol=tol), (chunked, plain)
    assert "wte.weight" in chunked_grads  # the tied weight: embedding and LM head gradients, summed
    for name, g in plain_grads.items():
        scale = g.abs().max().item() or 1.0
        err = (chunked_grads[name] - g).abs().max().item() / scale
        assert err <= tol * (5 if amp else 1), (name, err)


def test_ignored_targets_and_a_scaled_loss_match_cross_entropy():
    torch.manual_seed(2)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    t = torch.randint(0, 12, (10,))
    t[3] = -100
    ref = F.cross_entropy(x @ w.t(), t)
    (3 * ref).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = ChunkedCrossEntropy.apply(x, w, t)
    (3 * out).backward()
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.allclose(x.grad, gx, atol=1e-5) and torch.allclose(w.grad, gw, atol=1e-5)
    with torch.no_grad():  # evaluation: the loss alone
        assert torch.allclose(ChunkedCrossEntropy.apply(x, w, t), ref, atol=1e-6)


def test_the_measured_peak_drops(monkeypatch):
    """With a vocabulary much wider than the model the logits dominate the peak: the chunked loss
    removes them from it."""
    monkeypatch.setattr(chunked_loss, "LOSS_CHUNK_ELEMENTS", 4096 * 16)  # 16 of the 128 rows a chunk

    def peak(chunked):
        m = make(chunked, vocab=4096)
        opt = torch.optim.AdamW(m.parameters())
        x = torch.randint(0, 4096, (8, 16))
        for step in (1, 2):
            with capture_memory(m, opt, step) if step == 2 else nullcontext() as cap:
                m(x, torch.roll(x, -1, 1))[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return cap.breakdown

    plain, chunked = peak(False), peak(True)
    assert chunked.peak < 0.8 * plain.peak, (chunked.peak, plain.peak)
    assert not any("log-probs" in k for k in chunked.activations)
