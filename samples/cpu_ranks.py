"""Helpers the samples share: run a function on N local CPU ranks joined in a gloo group."""
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, world, port, body, args, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results[rank] = body(rank, args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(body, args, world: int) -> list:
    """Spawns `world` processes in one gloo group on a free local port, runs `body(rank, args)`
    on each (body must be a module-level function) and returns their results in rank order."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_entry, args=(world, free_port(), body, args, results), nprocs=world, join=True)
        return [results[rank] for rank in range(world)]
