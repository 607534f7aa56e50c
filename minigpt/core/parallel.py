"""Past one device: FSDP2 and tensor parallelism on a 2-D ("dp", "tp") DeviceMesh, as torchtitan does.

    torchrun --nproc_per_node 2 train_minimal.py --fsdp          # parameters, grads, AdamW state sharded
    torchrun --nproc_per_node 2 train_minimal.py --tp 2          # each block's matrices split in two
    torchrun --nproc_per_node 4 train_minimal.py --fsdp --tp 2   # 2 x 2: FSDP across, TP within
    torchrun --nproc_per_node 8 train_minimal.py --fsdp --use-tensor-parallel  # TP over one node's ranks

Plain data parallelism stays DDP (minigpt/core/distributed.py). The order is torchtitan's: tensor
parallelism first (it turns the block's weights into DTensors on the "tp" sub-mesh), then FSDP2's
`fully_shard` on each block and on the root (it shards every parameter, DTensor or not, along
"dp"). How the model is split, and why, is in `parallelize` and docs/parallel.md.

`check_plan` refuses every combination that cannot work before any process group exists: a
mistake costs one line, not a hung job. Knows minigpt's GPT (the module names in TP_PLAN).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from minigpt.config import UsageError


@dataclass(frozen=True)
class Plan:
    """How the run is split: the mesh and this rank's place in it."""

    mesh: object = None  # DeviceMesh under --fsdp/--tp, else None
    rank: int = 0
    dp_rank: int = 0  # batches are drawn by it: the ranks of one tp group see the same batch
    dp: int = 1
    tp_rank: int = 0
    tp: int = 1
    fsdp: bool = False
    sharded: bool = False  # FSDP or TP: DTensor parameters, sharded checkpoints
    worker: str = "rank0_dp0"  # names this rank's trace and memory files


# Tensor parallelism inside each block: the first matrix of each pair split by its output columns,
# the second by its input rows, so each pair costs one all-reduce forward and one backward
# (Megatron-LM's split). qkv's rows are regrouped first: see _group_qkv_by_rank.
TP_PLAN = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
MESH_DIMS = ("dp", "tp")


def world_size_from_env() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def tp_degree(cfg, world_size: int | None = None) -> int:
    """The tensor-parallel degree: --tp N, or with --use-tensor-parallel every rank of one node
    (torchrun's LOCAL_WORLD_SIZE), where the links are fastest."""
    if getattr(cfg, "use_tensor_parallel", False):
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size or world_size_from_env()))
    tp = getattr(cfg, "tp", 1)
    return 1 if tp is None else int(tp)


def check_plan(cfg, world_size: int) -> None:
    """Raise UsageError (one line) for any --fsdp / --tp / --use-tensor-parallel combination that
    cannot work. Touches no process group: called before distributed.setup()."""
    fsdp, use_tp = bool(getattr(cfg, "fsdp", False)), bool(getattr(cfg, "use_tensor_parallel", False))
    tp_flag = getattr(cfg, "tp", 1)
    tp_flag = 1 if tp_flag is None else int(tp_flag)
    if not (fsdp or tp_flag != 1 or use_tp):
        return  # DDP or a single process: nothing of this module is used
    if tp_flag < 1:
        raise UsageError(f"--tp must be positive, got {tp_flag}")
    if use_tp and tp_flag not in (1, tp_degree(cfg, world_size)):
        raise UsageError(
            f"--use-tensor-parallel means --tp {tp_degree(cfg, world_size)} (this node's "
            "ranks); "
            f"it contradicts --tp {tp_flag}: pass one of them"
        )
    tp = tp_degree(cfg, world_size)
    names = " ".join(
        n
        for n, on in (("--fsdp", fsdp), (f"--tp {tp_flag}", tp_flag != 1), ("--use-tensor-parallel", use_tp))
        if on
    )
    if world_size < 2:
        raise UsageError(
            f"{names} shards the model across processes: launch with torchrun and 2 or more "
            "(torchrun --nproc_per_node 2 train_minimal.py ...); one process trains unsharded"
        )
    if world_size % tp:
        raise UsageError(
            f"the world size {world_size} is not divisible by the tensor-parallel degree {tp}; "
            "use a --tp that divides the number of processes"
        )
    if cfg.n_heads % tp:
        raise UsageError(
            f"--n-heads {cfg.n_heads} is not divisible by the tensor-parallel degree {tp}: "
            "each rank computes whole attention heads"
        )
    if cfg.d_ff % tp:
        raise UsageError(
            f"--d-ff {cfg.d_ff} is not divisible by the tensor-parallel degree {tp}: "
            "each rank holds an equal slice of the MLP"
        )
    if tp > 1 and world_size > tp and not fsdp:
        raise UsageError(
            f"--tp {tp} on {world_size} processes leaves a data-parallel dimension of "
            f"{world_size // tp}: add --fsdp to shard it (DDP does not compose with TP here)"
        )
    if cfg.compile:
        raise UsageError(
            f"--compile with {names} is not supported: minigpt compiles the whole model, and "
            "FSDP2's hooks and DTensor ops need per-block compilation (as torchtitan does)"
        )
    if getattr(cfg, "amp_dtype", "bf16") == "fp16" and getattr(cfg, "amp", None) is not False:
        raise UsageError(
            f"{names} with --amp-dtype fp16 is not supported: its GradScaler is untested on "
            "sharded gradients here; use bf16 (or --no-amp)"
        )
    # Activation checkpointing composes: the model checkpoints each (FSDP-wrapped) block, and during
    # the recomputation FSDP2 all-gathers that block's parameters again, as torchtitan's AC does.


def build_mesh(world_size: int, tp: int, device: str):
    """The 2-D ("dp", "tp") DeviceMesh over all ranks (None for a single process). Ranks that
    differ only in their "tp" coordinate are neighbours (rank = dp * tp + t), so with tp equal to
    the processes per node, TP's all-reduces stay inside a node. Needs the process group."""
    if world_size < 2:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=MESH_DIMS)


def mesh_coords(rank: int, mesh) -> tuple[int, int, int, int]:
    """(dp rank, dp size, tp rank, tp size) of this process (without a mesh: rank, 1, 0, 1)."""
    if mesh is None:
        return rank, 1, 0, 1
    return (mesh.get_local_rank("dp"), mesh["dp"].size(), mesh.get_local_rank("tp"), mesh["tp"].size())


def worker_name(rank: int, mesh) -> str:
    """InternEvo's per-rank folder name: rank{R}_dp{d}_tp{t}; rank{R}_dp{R} without TP."""
    dp, _, t, tp = mesh_coords(rank, mesh)
    return f"rank{rank}_dp{dp}" + (f"_tp{t}" if tp > 1 else "")


def describe(plan: Plan, amp_dtype: str) -> str:
    """The log line of a sharded plan (--fsdp / --tp)."""
    parts = []
    if plan.fsdp:
        mp = "bf16 params, fp32 reduce" if amp_dtype == "bf16" else "fp32"
        parts.append(f"FSDP2 over dp {plan.dp} ({mp})")
    if plan.tp > 1:
        parts.append(
            f"tensor parallel {plan.tp} (qkv, mlp.fc column-wise; attn.proj, mlp.proj row-wise; "
            "embeddings and head replicated)"
        )
    return "; ".join(parts) + f"; mesh dp {plan.dp} x tp {plan.tp}; this rank {plan.worker}"


def make_plan(cfg, rank: int, world_size: int, device: str) -> Plan:
    """The mesh (after distributed.setup) and this rank's coordinates. Batches are drawn by
    dp_rank: the ranks of one tp group must see the same batch."""
    tp = tp_degree(cfg, world_size) if world_size > 1 else 1
    fsdp = bool(getattr(cfg, "fsdp", False)) and world_size > 1
    if not (fsdp or tp > 1):  # DDP or one process: no mesh (and no sub-groups) needed
        return Plan(None, rank, rank, world_size, worker=worker_name(rank, None))
    mesh = build_mesh(world_size, tp, device)
    dp_rank, dp, tp_rank, tp = mesh_coords(rank, mesh)
    return Plan(mesh, rank, dp_rank, dp, tp_rank, tp, fsdp, True, worker_name(rank, mesh))


def _group_qkv_by_rank(linear: nn.Linear, n_heads: int, tp: int) -> None:
    """Reorder qkv's output rows from [q | k | v] (all heads) to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...],
    where q_r are the rows of the heads of tensor-parallel rank r. ColwiseParallel gives rank r the
    r-th contiguous slice of rows, which is then exactly [q | k | v] of its own heads, and the
    attention's forward (which splits its qkv output in three) works unchanged on the local slice.
    The permutation is part of the sharded checkpoint: load_sharded refuses another --tp."""
    C = linear.in_features
    per = C // tp
    order = torch.cat(
        [torch.arange(part * C + r * per, part * C + (r + 1) * per) for r in range(tp) for part in range(3)]
    )
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def parallelize(model: nn.Module, cfg, mesh, device: str, amp_dtype: str) -> nn.Module:
    """Apply the plan to minigpt's GPT in place and return the module to train (the model itself
    under FSDP/TP, a DDP wrapper for plain data parallelism, the model alone without a mesh).
    Every rank must hold the same initial weights (the same seed), as DDP requires.

    Tensor parallelism, per block: attn.qkv and mlp.fc ColwiseParallel (each rank computes its
    own heads and its own slice of the MLP), attn.proj and mlp.proj RowwiseParallel (partial sums,
    all-reduced into the residual stream). LayerNorms, the position embedding and the token
    embedding with its tied LM head stay replicated: every tp rank computes them in full. Why not
    vocab-parallel: the head is tied to wte, so the embedding (RowwiseParallel, sharded by vocab
    row) and the head (ColwiseParallel, also by vocab row) would have to share one DTensor, and
    the loss over vocab-sharded logits needs loss_parallel() around the trainer's forward and
    backward and in evaluation. Replicating costs V*h parameters per tp rank (31% of gpt2's) and
    the full logits per rank; with --fsdp those parameters are still sharded along "dp".

    FSDP2: fully_shard on each block, then on the root (embeddings, ln_f, head), with
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under bf16 AMP: blocks compute on
    bf16 copies gathered from fp32 shards, gradients are reduced in fp32."""
    if mesh is None:
        return model
    tp = mesh["tp"].size()
    fsdp = bool(getattr(cfg, "fsdp", False))
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in model.blocks:
            _group_qkv_by_rank(block.attn.qkv, block.attn.n_heads, tp)
            parallelize_module(block, mesh["tp"], {name: styles[s]() for name, s in TP_PLAN.items()})
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if amp_dtype == "bf16"
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
        return model
    if tp > 1:
        return model  # TP alone: check_plan made sure the whole world is the "tp" dimension
    from torch.nn.parallel import DistributedDataParallel

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return DistributedDataParallel(model, device_ids=[local_rank] if device == "cuda" else None)


# ---------------------------------------------------------------------------- training with DTensors


def loaded_dtensor() -> type | None:
    """DTensor, or None while torch.distributed.tensor was never imported: then no tensor can be
    one. A plain run does not pay for its import (seconds of start-up: torch.distributed.tensor
    loads every sharding rule)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def split_by_mesh(groups: list[dict]) -> list[dict]:
    """Split each optimizer parameter group by the kind of its tensors: plain, or DTensor on a given
    mesh. AdamW's fused and foreach kernels take one list of tensors per group, and a list that mixes
    plain tensors and DTensors, or DTensors of two meshes, fails ("got mixed torch.Tensor and
    DTensor"). Under TP alone the LayerNorms and embeddings stay plain; under FSDP x TP the blocks'
    matrices live on the 2-D mesh and everything else on "dp". Each group keeps its settings. So
    split, the fused AdamW runs on DTensor parameters too (on the CPU as well: _fused_adamw_ on
    each local shard, checked in tests/test_parallel.py)."""
    DTensor = loaded_dtensor()
    if DTensor is None:
        return groups
    out = []
    for group in groups:
        kinds: dict = {}
        for q in group["params"]:
            key = (id(q.device_mesh), q.device_mesh.ndim) if isinstance(q, DTensor) else None
            kinds.setdefault(key, []).append(q)
        out += [{**group, "params": qs} for qs in kinds.values()]
    return out


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for a mix of plain and DTensor gradients (TP leaves the LayerNorms and
    embeddings plain; FSDP puts blocks on the 2-D mesh and the root on "dp"), which torch's own
    refuses to stack. The squared norm of each DTensor group is summed over its shards with one
    all-reduce per (mesh, placements) group; replicated copies are counted once. Returns the total
    norm (a plain tensor, the same on every rank)."""
    parameters = list(parameters)
    DTensor = loaded_dtensor()
    if DTensor is None or not any(isinstance(p, DTensor) for p in parameters):  # a plain model: torch's own
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    from torch.distributed.tensor import Partial, Replicate, Shard

    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    groups: dict[tuple, list] = {}
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if plain:
        total_sq += torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in plain]).sum()
    for (mesh, placements), gs in groups.items():
        local = torch.stack([torch.linalg.vector_norm(g.to_local().float()) ** 2 for g in gs]).sum()
        partial = [Partial("sum") if isinstance(p, Shard) else Replicate() for p in placements]
        total_sq += DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, else `t` (e.g. for torch.isfinite checks,
    which on a DTensor would need a collective)."""
    DTensor = loaded_dtensor()
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> tuple[tuple, int]:
    """(a key of the storage, its bytes) for what this rank holds of `t`: a DTensor's local shard.
    FSDP2's sharded gradients are views into one reduce-scatter buffer per block: keyed by
    storage, the buffer is counted once."""
    DTensor = loaded_dtensor()
    if DTensor is not None and isinstance(t, DTensor):
        t = t.to_local()
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()), storage.nbytes()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's parameter, gradient and AdamW-state bytes: local shards, each storage once (a
    tied weight, a shared buffer)."""
    out = {"params": 0, "grads": 0, "optimizer": 0}
    seen: set[tuple] = set()

    def add(category: str, t: torch.Tensor) -> None:
        key, nbytes = local_bytes(t)
        if key not in seen:
            seen.add(key)
            out[category] += nbytes

    for q in model.parameters():
        add("params", q)
    for q in model.parameters():
        if q.grad is not None:
            add("grads", q.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    add("optimizer", v)
    return out
