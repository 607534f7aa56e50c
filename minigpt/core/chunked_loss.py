"""--chunked-loss: the LM head and the cross-entropy over chunks of rows, so that no N x V tensor
(the logits, their fp32 copy, the log-probabilities, their gradient) is ever whole. Loaded by
minigpt/core/model.py's forward when the flag is on."""

from __future__ import annotations

import torch

# Rows per chunk of the chunked loss: as many as make 2^24 logits (64 MiB in fp32). Smaller chunks
# save little more (the loss's other tensors are N x h), larger ones give the memory back.
LOSS_CHUNK_ELEMENTS = 2**24


def loss_chunk(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    grad_scale: torch.Tensor | None,
):
    """One chunk of rows: (sum of its losses, and, when grad_scale is given, d(loss)/d(x rows) and
    d(loss)/d(weight) for loss = sum * grad_scale). The logits are made in `dtype` (autocast's)
    and turned into fp32 for the softmax, as F.cross_entropy does under autocast."""
    logits = (x.to(dtype) @ weight.to(dtype).t()).float()
    valid = targets != -100  # F.cross_entropy's ignore_index
    safe = targets.clamp(min=0).unsqueeze(1)
    lse = torch.logsumexp(logits, dim=1)
    loss_sum = ((lse - logits.gather(1, safe).squeeze(1)) * valid).sum()
    if grad_scale is None:
        return loss_sum, None, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits' memory
    probs.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=probs.dtype))
    probs.mul_((valid * grad_scale).unsqueeze(1))
    g = probs.to(dtype)
    return loss_sum, g @ weight.to(dtype), g.t() @ x.to(dtype)


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean cross_entropy(x @ weight.T, targets), computed a chunk of rows at a time.

    The plain path makes the logits (N x V), their fp32 copy for the softmax, the fp32
    log-probabilities it saves for backward, and in backward their gradient: four N x V tensors at
    once (memory.log's peak_layout shows them). Here the forward computes, chunk by chunk, the loss
    and its gradients for x and the weight (a loss is the end of the graph: its own gradient is a
    scalar, applied in backward), so no N x V tensor is kept and no logits are computed twice.
    Under autocast the matmuls run in autocast's dtype and the softmax in fp32, as in the plain path."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        n_valid = (targets != -100).sum().clamp(min=1).float()  # a tensor: no device sync
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows = max(1, LOSS_CHUNK_ELEMENTS // weight.size(0))
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_grad else None
        with torch.autocast(device, enabled=False):
            for i in range(0, x.size(0), rows):
                part, gx, gw = loss_chunk(
                    x[i : i + rows],
                    weight,
                    targets[i : i + rows],
                    dtype,
                    1.0 / n_valid if need_grad else None,
                )
                total += part
                if need_grad:
                    grad_x[i : i + rows] = gx
                    grad_w += gw
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss.to(grad_x.dtype), (grad_w * grad_loss).to(grad_w.dtype), None
