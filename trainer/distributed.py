"""Several processes under torchrun: DDP on NCCL (CUDA) or gloo (CPU).

Only global rank 0 talks to MLflow and writes files; losses are averaged across ranks so every
rank sees the same stats and stops together on a NaN.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import wait
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.daemon_call import daemon_call
from trainer.errors import UserError

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=30)  # torch's join (and collective) timeout
JOIN_NOTICE_S = 60.0  # while the others have not come, say so this often


@dataclass(frozen=True)
class Context:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def check_devices() -> None:
    """One process per GPU (each takes the GPU of its LOCAL_RANK): a node started with more processes
    than it has GPUs fails on every rank before a run is made."""
    processes = max(int(os.environ.get("LOCAL_RANK", "0")) + 1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if torch.cuda.is_available() and processes > (count := torch.cuda.device_count()):
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r})"
        raise UserError(f"{processes} processes on this node, but it has {count} GPU{'s' * (count != 1)} visible{shown}: "
                        f"one process per GPU, start at most torchrun --nproc-per-node {count}")


def setup() -> Context:
    """Read torchrun's environment and join the process group; a lone process needs nothing."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return Context(device=device)
    if not dist.is_initialized():
        _warn_shared_store()
        _join_group("nccl" if device.type == "cuda" else "gloo", device, world_size)
    return Context(dist.get_rank(), world_size, local_rank, device)


def _join_group(backend: str, device: torch.device, world_size: int) -> None:
    """init_process_group on a thread of its own: torch waits for the other processes in C++, where no
    Python signal handler runs, so the main thread waits in Python, where a SIGTERM can stop the job."""
    def join():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        # device_id binds NCCL to this rank's GPU (else its barriers guess one and warn that they do)
        dist.init_process_group(backend, timeout=JOIN_TIMEOUT, device_id=device if device.type == "cuda" else None)

    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    log.info("joining the job's %d processes (rank 0 at %s)", world_size, where)
    joined = daemon_call(join, "process-group-join")
    while not wait([joined], JOIN_NOTICE_S).done:
        log.warning("still waiting for the job's other processes (rank 0 at %s); torch gives up after %s",
                    where, JOIN_TIMEOUT)
    joined.result()


def _warn_shared_store() -> None:
    """torchrun's agents lend their workers the rendezvous store by default, and it outlives a restart
    with the dead workers' keys under a restart count the agents of several nodes disagree on
    (pytorch#135712): a restart after a failure then never joins. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    in torchrun's environment, rank 0 hosts a fresh store at every start (our manifests set it)."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0"):
        log.warning("torchrun shares its rendezvous store with the workers: a restart on several nodes will not "
                    "rejoin (pytorch#135712). Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")


def environment(ctx: Context) -> dict[str, str]:
    """What the job runs on: versions, device, world size (tags of its run)."""
    import platform

    import torchvision

    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda or "none", "device": device, "world_size": str(ctx.world_size)}


def teardown(ctx: Context, together: bool = False) -> None:
    """`together` where every rank stops at the same point (a failed check): each waits for the
    others first, so that rank 0 has marked the run before any rank exits (torchrun then stops
    the rest with SIGTERM)."""
    if ctx.distributed and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def all_mean(ctx: Context, values: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of a small vector (one collective per iteration)."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= ctx.world_size
    return values


def broadcast_object(ctx: Context, obj):
    """Rank 0's value on every rank (the resume decision, the run id)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Keys every rank must share beyond job_identity.job_keys: when a checkpoint is made and evaluation
# runs (both collective: a rank doing either alone waits in it forever), on what and at which size
# (rank 0 scores the detections of every rank's shard).
SHARED_KEYS = ("TRAIN.SNAPSHOT_ITERS", "TEST.DATASETS", "TEST.EVAL_PERIOD", "TEST.SCALE", "TEST.MAX_SIZE")


def check_same_job(ctx: Context, keys: dict, data: dict | None = None) -> None:
    """Every rank was started with rank 0's job: `keys` (job_identity.job_keys and SHARED_KEYS; paths and
    tracking may differ by node) and `data`, what its training set is to the model (None where a finished
    job's data is gone)."""
    if not ctx.distributed:
        return
    every = all_gather_object(ctx, (keys, data))  # each rank sees them all, so all stop with the same line
    first, first_data = every[0]
    for rank, (theirs, their_data) in enumerate(every):
        data_differ = _differ(first_data, their_data) if first_data is not None and their_data is not None else []
        if differ := _differ(first, theirs) + data_differ:
            what, same = (("other training data", "datasets (DATA_DIR, DATASET_CATALOG)") if differ == data_differ
                          else ("another config", "config and overrides"))
            raise UserError(f"rank {rank} was started with {what} than rank 0 ({', '.join(differ[:5])}"
                            f"{' ...' if len(differ) > 5 else ''} differ): every process of a job needs the same {same}")


def _differ(ours: dict, theirs: dict) -> list[str]:
    return sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))


def all_gather_object(ctx: Context, obj) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, obj)
    return every


def gather_object(ctx: Context, obj) -> list:
    """Every rank's value, in rank order, on rank 0 (other ranks get [])."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out or []

