"""Who this process is in the job: its rank, the world, and its place in the parallel plan.

Plain records, torch-free. A single process (no torchrun) is the defaults: rank 0 of a world of
1, writing the run's files, in a plan of one data-parallel rank. Under torchrun,
minigpt/core/distributed.py fills DistInfo and minigpt/core/parallel.py fills Plan."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # None: a single process, no process group
    host: str = socket.gethostname()
    control: object = None  # the gloo group for host-side control messages
    is_main: bool = True  # rank 0: it writes the run's files
    enabled: bool = False  # more than one rank: collectives run


@dataclass(frozen=True)
class Plan:
    """How this run is split: the mesh and this rank's place in it."""

    mesh: object = None  # DeviceMesh under --fsdp/--tp, else None
    rank: int = 0
    dp_rank: int = 0  # batches are drawn by it: the ranks of one tp group see the same batch
    dp: int = 1
    tp_rank: int = 0
    tp: int = 1
    fsdp: bool = False
    sharded: bool = False  # FSDP or TP: DTensor parameters, sharded checkpoints
    worker: str = "rank0_dp0"  # names this rank's trace and memory files
