"""Run train_minimal.cli under torchrun and leave behind what the DDP tests inspect.

    torchrun --nproc_per_node 2 tests/ddp_probe.py OUT_FILE_PREFIX [trainer flags...]

Writes OUT_FILE_PREFIX.rank{R}.pt with this rank's first gradients (captured where the trainer
clips them, after the all-reduce) and its final weights, and OUT_FILE_PREFIX.rank{R}.json with its
exit status and the time its last line was said. PROBE_FAIL="RANK:STEP:raise|exit|kill|stop" makes
that rank fail at that step, to test how the job ends (a stopped rank writes the time it stopped
to OUT_FILE_PREFIX.rank{R}.stopped first).
"""

import json
import os
import signal
import subprocess
import sys
import time

import torch

import train_minimal

rank = int(os.environ.get("RANK", 0))
prefix, argv = sys.argv[1], sys.argv[2:]
models, grads = [], {}


class ProbedGPT(train_minimal.GPT):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        models.append(self)


real_clip = torch.nn.utils.clip_grad_norm_


def probed_clip(params, *args, **kwargs):
    params = list(params)
    if not grads:
        grads.update({n: p.grad.detach().clone() for n, p in models[0].named_parameters()})
    return real_clip(params, *args, **kwargs)


train_minimal.GPT = ProbedGPT
torch.nn.utils.clip_grad_norm_ = probed_clip

on_step = None
if os.environ.get("PROBE_FAIL"):
    fail_rank, fail_step, how = os.environ["PROBE_FAIL"].split(":")

    def on_step(step):  # train_minimal.main's seam: called as each step starts
        if rank == int(fail_rank) and step == int(fail_step):
            if how == "exit":
                os._exit(13)  # the process dies without a word, as a killed rank would
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer or `kill -9` does
            if how == "stop":  # alive but not answering (kill -STOP, a hung host)
                # Killed once the other rank has ended (its --ddp-timeout found this one lost), or
                # after PROBE_KILL_AFTER s: torchrun's own SIGTERM would wait on a stopped process
                # for 30 s before its SIGKILL.
                tenths, other = int(10 * float(os.environ.get("PROBE_KILL_AFTER", "60"))), 1 - rank
                ended = f"{prefix}.rank{other}.json"
                wait = f"for i in $(seq {tenths}); do [ -e {ended} ] && break; sleep 0.1; done"
                subprocess.Popen(["sh", "-c", f"{wait}; kill -KILL {os.getpid()}"])
                with open(f"{prefix}.rank{rank}.stopped", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError(f"probe failure on rank {rank} at step {step}")


status = train_minimal.cli(argv, on_step=on_step)
with open(f"{prefix}.rank{rank}.json", "w") as f:
    json.dump({"status": status, "ended": time.time()}, f)
torch.save(
    {"grads": grads, "params": {k: v.detach().clone() for k, v in models[0].state_dict().items()}},
    f"{prefix}.rank{rank}.pt",
)
sys.exit(status)
