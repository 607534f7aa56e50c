"""Data parallelism through torchrun: process group, DDP, and the few collectives the trainer needs.

    torchrun --nproc_per_node 2 train_minimal.py ...            # one node, 2 processes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train_minimal.py ...

torchrun starts the processes and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
`join()` reads them, joins the process group and returns (DistInfo, Plan). A single process loads
this module only for a flag that needs the ranks (--fsdp, --simulate-slow-rank...): it is then rank
0 of 1. Knows nothing of GPT; the wrapper, the stop vote and the straggler scores of the training
loop are minigpt/instruments/straggler.py's Ranks.

Besides the default group (NCCL on CUDA, gloo on the CPU), a gloo group on the host carries the
small control messages: the per-step "stop now?" vote and the straggler figures. Host tensors
through gloo never make the host wait for the GPU, so they cost no synchronisation on CUDA.
"""

from __future__ import annotations

import gc
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from minigpt.errors import Fault, NonFiniteLoss, UsageError


class LostRank(Fault):
    """A peer process ended or stopped answering mid-run."""


@dataclass(frozen=True)
class DistInfo:
    """This process in the job (a single process is rank 0 of 1, and writes the run's files)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # None: no process group
    host: str = ""
    control: object = None  # the gloo group of the host-side messages
    is_main: bool = True
    enabled: bool = False  # more than one rank: collectives run


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device: str, backend: str | None, timeout_s: float) -> DistInfo:
    """Join the process group torchrun describes in the environment (a no-op without torchrun).
    `timeout_s` bounds every collective: a rank that died or hangs ends the job with an error
    after that long instead of leaving the others waiting for ever."""
    if not launched_by_torchrun():
        return DistInfo()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        check_one_gpu_per_rank(local_rank)
        torch.cuda.set_device(local_rank)  # "cuda" now means this process's own GPU
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=torch.device("cuda", local_rank) if backend == "nccl" else None,
        )
    except dist.DistError as e:  # DistStoreError, DistNetworkError: a rank that never came
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LostRank(
            f"rank {rank}: the {world_size} ranks of this torchrun job did not all join the process group "
            f"within --ddp-timeout {timeout_s:g} s (a rank exited or was stopped before it joined: its "
            f"own output says why) [{type(e).__name__}: {first[:200]}]"
        ) from None
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    host = socket.gethostname()
    return DistInfo(rank, local_rank, world_size, backend, host, control, rank == 0, world_size > 1)


def check_one_gpu_per_rank(local_rank: int) -> None:
    """More ranks on this machine than visible GPUs: one line, before CUDA or NCCL fails inside
    set_device or the first collective. Every rank of the machine says the same line; torchrun
    then ends the job."""
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        raise UsageError(
            f"{ranks} ranks on this machine (torchrun --nproc_per_node {ranks}) but {gpus} visible "
            f"GPU{'' if gpus == 1 else 's'}: each rank needs a GPU of its own; start at most {gpus} "
            f"rank{'' if gpus == 1 else 's'} (--nproc_per_node {gpus}), or train the ranks on the CPU "
            "with --device cpu (gloo)"
        )


def cleanup() -> None:
    """Destroy the process group; safe to call on every exit path, and more than once."""
    if dist.is_available() and dist.is_initialized():
        # Free what still holds the group (the DDP wrapper and its reducer sit in reference
        # cycles) while the interpreter is whole, not during its shutdown: once, under load, a
        # rank aborted at exit with "terminate called without an active exception".
        gc.collect()
        dist.destroy_process_group()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if it is true on any: all ranks stop at the same step, or none does
    (a rank that left alone would leave the others waiting in the next all-reduce)."""
    if not info.enabled:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.control)
    return bool(t.item())


def check_peers_finite(mine_bad: bool, step: int, info: DistInfo, checkpoint) -> None:
    """Every rank learns whether any rank's loss became non-finite: all stop at the same step, each
    rank whose own loss is finite with this line (a rank whose loss is not says its own)."""
    from minigpt.core.guards import describe_intact

    if any_rank(mine_bad, info) and not mine_bad:
        raise NonFiniteLoss(
            f"another rank's loss became non-finite by step {step}; {describe_intact(checkpoint)}; lower --lr"
        )


def gather(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order, on every rank (through the host-side gloo group)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj, group=info.control)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier(group=info.control)


def time_backward_compute(ddp_model: torch.nn.Module, on_ready) -> None:
    """Register a DDP communication hook that calls `on_ready()` as each gradient bucket becomes
    ready, then all-reduces it as DDP would. The last call marks the end of the backward's own
    compute: what follows in the backward is the wait for the all-reduce, which grows on the fast
    ranks when another rank is slow. Straggler scores use the compute, not the wait."""

    def hook(state, bucket):
        on_ready()
        return default_hooks.allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(None, hook)


def check_same_config(cfg, info: DistInfo) -> None:
    """At start-up, before anything is built: every rank's resolved configuration must be rank
    0's. Ranks started with different flags otherwise fail later and far from the cause: a
    different --d-model with a traceback on every rank, a different --num-steps, --log-interval
    or --fsdp by hanging in a collective until --ddp-timeout, a different --grad-accum-steps
    silently. `cfg`: a minigpt.config.TrainConfig. Rank 0's run id (drawn per process) is taken
    by every rank. Raises UsageError naming the first flag that differs, on every rank."""
    if not info.enabled:
        return
    from minigpt.config import FIELDS, flag_name

    everyone = gather(cfg.to_dict(), info)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], 1):
        for key in first:
            if key != "run_id" and theirs.get(key) != first.get(key):
                name = flag_name(key) if key in FIELDS else key
                raise UsageError(
                    f"the ranks were started with different flags: {name} "
                    f"is {theirs.get(key)!r} on rank {rank} but {first.get(key)!r} on rank 0; start "
                    "every rank with the same flags (and the same $MINIGPT_ARGS)"
                )
    cfg.run_id = first.get("run_id")


# ---------------------------------------------------------------------------- a lost rank

CHECK_IN_S = 5.0  # how long survivors wait for each other's word before naming a rank lost
_CHECK_IN = "minigpt/alive/{attempt}/{rank}"  # a key per rank (and per torchrun restart) in its store
# What a collective says when its peer is gone: gloo's "Connection closed by peer", a reset or broken
# connection, NCCL's and c10d's own errors; or, for a peer alive but stopped, --ddp-timeout running
# out: gloo's "Timed out waiting 20000ms for recv", and on the other buckets in flight through the
# same connection "Application timeout caused pair closure" (issue 47: it names no backend), both
# wrapped by DDP's communication hook in "Got the following error when running the callback".
BACKEND_ERROR = re.compile(
    r"gloo|nccl|c10d|connection (closed|reset|refused)|broken pipe|timed out|timeout|pair closure"
    r"|error when running the callback",
    re.IGNORECASE,
)


def lost_ranks(info: DistInfo, wait_s: float = CHECK_IN_S) -> list[int] | None:
    """The ranks that did not answer, after a collective failed. Every survivor writes a key of its
    own in torchrun's store (its agent hosts it, so it outlives any rank) and waits
    up to `wait_s` for the others' keys: a rank whose key never comes is gone or stopped. None when
    the store cannot be reached either (its host is gone: then nothing can be said of the others)."""
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=wait_s),
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store.set(_CHECK_IN.format(attempt=attempt, rank=info.rank), "1")
        others = [r for r in range(info.world_size) if r != info.rank]
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in others if not store.check([_CHECK_IN.format(attempt=attempt, rank=r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except (KeyError, ValueError, RuntimeError, OSError):  # no torchrun environment, or no store
        return None


def as_lost_rank(error: BaseException, info: DistInfo, resume: str) -> LostRank | None:
    """A collective's failure because another rank is gone (killed, out of memory, stopped) as
    LostRank, whose one line names that rank and says `resume` (how to go on); None for any other
    error, and for a failure with every rank still answering: it is not about a lost rank."""
    if not info.enabled or not isinstance(error, RuntimeError):  # dist.DistError is one
        return None
    if not (isinstance(error, dist.DistError) or BACKEND_ERROR.search(str(error))):
        return None
    lost = lost_ranks(info)
    if not lost:
        return None
    names = ", ".join(str(r) for r in lost)
    return LostRank(
        f"rank {info.rank}: lost rank{'s' if len(lost) > 1 else ''} {names} (it ended or stopped "
        f"answering: its own output or torchrun's summary says why); {resume}"
    )


# ---------------------------------------------------------------------------- the rank flags


@dataclass
class SlowRank:
    """--simulate-slow-rank R:MS[:STAGE]: rank R sleeps MS milliseconds inside STAGE each step."""

    rank: int
    ms: float
    stage: str = "forward"


MAX_SLOW_MS = 3_600_000.0  # an hour per step: time.sleep overflows past ~1e16 s


def check_slow_rank(spec: str) -> None:
    """--simulate-slow-rank's numbers bounded (the format itself: straggler.parse_slow_rank): a delay
    of 1e99 ms overflows time.sleep with a traceback in the first step."""
    parts = spec.split(":")
    try:
        rank, ms = int(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return  # parse_slow_rank names the format
    if not -(2**63) < rank < 2**31:
        raise UsageError(f"--simulate-slow-rank {spec}: the rank must be below 2**31")
    if math.isfinite(ms) and ms > MAX_SLOW_MS:
        raise UsageError(
            f"--simulate-slow-rank {spec}: the delay must be at most {MAX_SLOW_MS:.0f} ms (an hour per step)"
        )


def parse_slow_rank(spec: str, stages: tuple[str, ...]) -> SlowRank:
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        slow = SlowRank(int(parts[0]), float(parts[1]), *parts[2:])
    except ValueError:
        raise UsageError(
            f"--simulate-slow-rank takes RANK:MS or RANK:MS:STAGE (e.g. 1:200:forward); got {spec!r}"
        ) from None
    if slow.rank < 0 or not 0 < slow.ms < float("inf"):
        raise UsageError(f"--simulate-slow-rank {spec}: the rank must be >= 0 and the delay positive")
    if slow.stage not in stages:
        raise UsageError(
            f"--simulate-slow-rank {spec}: unknown stage {slow.stage!r}; one of {', '.join(stages)}"
        )
    return slow


def profile_ranks(spec: str, world_size: int | None) -> list[int] | None:
    """Parse --profile-ranks: 'all' (None: every rank) or a comma-separated list of ranks."""
    if spec.strip() == "all":
        return None
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        raise UsageError(f"--profile-ranks must be 'all' or a list like 0,1; got {spec!r}") from None
    if world_size is not None and any(not 0 <= r < world_size for r in ranks):
        raise UsageError(
            f"--profile-ranks {spec} names a rank outside 0..{world_size - 1} "
            f"(the world size is {world_size})"
        )
    return ranks


def join(cfg, device: str, held):
    """Under torchrun, or with a flag that needs the ranks: the checks that need the world, the
    process group (NCCL on CUDA, gloo on the CPU; destroyed when `held`, the run's ExitStack,
    closes) and the (dp, tp) mesh. Returns (DistInfo, Plan)."""
    from minigpt.config import STAGE_NAMES
    from minigpt.core import parallel

    if cfg.simulate_slow_rank:  # its numbers, then its format
        check_slow_rank(cfg.simulate_slow_rank)
    slow = parse_slow_rank(cfg.simulate_slow_rank, STAGE_NAMES) if cfg.simulate_slow_rank else None
    profile_ranks(cfg.profile_ranks, None)  # its format, before any process group
    parallel.check_plan(cfg, parallel.world_size_from_env())  # --fsdp / --tp: before any process group
    info = setup(device, cfg.ddp_backend, cfg.ddp_timeout)
    held.callback(cleanup)  # on every exit path: a process group left behind hangs or leaks
    check_same_config(cfg, info)  # ranks started with different flags: one line
    plan = parallel.make_plan(cfg, info.rank, info.world_size, device)  # the (dp, tp) mesh
    profile_ranks(cfg.profile_ranks, info.world_size)  # a rank outside the world: one line, before any work
    if slow and slow.rank >= info.world_size:
        raise UsageError(
            f"--simulate-slow-rank {cfg.simulate_slow_rank}: no rank {slow.rank} in a world of "
            f"{info.world_size}"
        )
    if slow and info.world_size == 1:  # nothing would sleep: the page times a single process plainly
        raise UsageError(
            f"--simulate-slow-rank {cfg.simulate_slow_rank} slows one rank among several: launch with "
            "torchrun (torchrun --nproc_per_node 2 train_minimal.py ...)"
        )
    return info, plan
