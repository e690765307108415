"""Several processes converting one artifact, launched by ``torchrun`` (no scheduler of our own).

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the processes join a gloo process
group: each converts its share of the output files, process 0 prepares the folder, collects
every file's record and writes the manifest, once, after all files are complete and hashed.
"""

from __future__ import annotations

import datetime
import os


class Group:
    """This process's place among the converting processes (world 1 without torchrun)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def from_env(cls) -> Group:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        minutes = int(os.environ.get("MOESHARD_DIST_TIMEOUT_MIN", "120"))
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=minutes))
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list:
        """Every process's ``obj``, in process order (all-gather of picklable objects)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
