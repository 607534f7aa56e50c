"""What a device runs natively, and so the dtype a run trains in: AMP's decision. (MFU's
denominator, the device's peak in its fastest dtype, is peak.py's, found at the first log line.)"""

from __future__ import annotations

import torch

from minigpt.config import UsageError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_bf16_features() -> dict[str, bool]:
    """What makes bf16 native on this CPU (torch's private checks, spelled here alone)."""
    return {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}


def resolve_amp(cfg, device: str) -> tuple[str, str]:
    """(the dtype the model trains in, the log's note): autocast where the hardware runs it
    natively; on a CPU without native bf16, fp32, faster there than emulated bf16, unless --amp."""
    native = torch.cuda.is_bf16_supported() if device == "cuda" else any(cpu_bf16_features().values())
    if cfg.amp is False:
        return "fp32", "AMP off (--no-amp): fp32" + ", matmuls in TF32 (--tf32)" * cfg.tf32
    if device == "cpu" and cfg.amp_dtype == "fp16":
        raise UsageError("--amp-dtype fp16 needs CUDA (its loss scaling); use bf16 on the CPU")
    if device == "cuda" and (cfg.amp_dtype == "fp16" or not native):
        return "fp16", "AMP on: fp16 autocast with loss scaling" + " (this GPU lacks bf16)" * (not native)
    if native or cfg.amp:
        return "bf16", "AMP on: bf16 autocast" + " as asked: no native bf16 here, expect it slower" * (
            not native
        )
    return "fp32", "AMP off: no native bf16 on this CPU (AVX512-BF16 or AMX): fp32 is faster; --amp forces it"
