"""--chunked-loss: the LM head and the cross-entropy over chunks of rows give the plain path's loss
and gradients (the tied weight's included), and a lower measured peak. The CPU's default loss
(model.CrossEntropy) gives F.cross_entropy's, in fp32 and under bf16 autocast."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from minigpt.core import chunked_loss
from minigpt.core import model as model_module
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


# The default loss on the CPU (model.CrossEntropy): F.cross_entropy's numbers with less memory traffic.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_loss_equals_cross_entropy(dtype, monkeypatch):
    """Loss and gradient of F.cross_entropy over the same logits (upcast to fp32, as autocast does),
    ignored targets, a ragged last block of rows and a scaled loss included; the logits untouched."""
    monkeypatch.setattr(model_module, "LOSS_ROWS", 4)  # 37 rows: ten blocks, the last of one row
    torch.manual_seed(3)
    logits = (4 * torch.randn(37, 300)).to(dtype).requires_grad_()
    before = logits.detach().clone()
    t = torch.randint(0, 300, (37,))
    t[[0, 9, 36]] = -100
    ref = F.cross_entropy(logits.float(), t)
    (0.25 * ref).backward()
    ref_grad, logits.grad = logits.grad, None
    loss = model_module.cross_entropy(logits, t)
    (0.25 * loss).backward()
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == dtype  # no fp32 N x V gradient reaches the LM head
    ulp = 1e-7 if dtype == torch.float32 else 2**-8  # the gradient is rounded once, as the reference's
    assert torch.allclose(logits.grad.float(), ref_grad.float(), rtol=ulp, atol=1e-9)
    assert not logits.grad[[0, 9, 36]].any()  # ignored rows add nothing
    assert torch.equal(logits.detach(), before)
    with torch.no_grad():  # evaluation: the loss alone
        assert torch.allclose(model_module.cross_entropy(logits, t), ref, rtol=1e-6, atol=1e-6)


def test_a_bf16_step_keeps_the_fp32_loss_and_the_gradients_of_the_plain_loss(monkeypatch):
    """On a fixed batch, the model's bf16 loss is its fp32 loss within bf16's rounding, and its
    gradients are those that F.cross_entropy under autocast gave (the loss before this path)."""
    torch.manual_seed(4)
    x = torch.randint(0, 256, (3, 16))
    y = torch.roll(x, -1, 1)
    _, fp32, _ = loss_and_grads(False, False, x, y)
    _, bf16, grads = loss_and_grads(False, True, x, y)
    monkeypatch.setattr(model_module, "cross_entropy", F.cross_entropy)
    _, plain, plain_grads = loss_and_grads(False, True, x, y)
    assert abs(bf16.item() - fp32.item()) < 2e-2 * fp32.item()
    assert torch.allclose(bf16, plain, rtol=1e-6, atol=1e-6)
    for name, g in plain_grads.items():
        scale = g.abs().max().item() or 1.0
        assert (grads[name] - g).abs().max().item() <= 1e-2 * scale, name
