"""Process groups named by `group_ep` strings (docs/semantics.md §0.3, CPU path).

A name resolves, in order: to a group given to `register_group`; to the c10d group of that
name (`ProcessGroup.group_name`); and "", "world" and "default" to the default (WORLD) group.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch.distributed as dist

_REGISTERED: Dict[str, "dist.ProcessGroup"] = {}
_WORLD_NAMES = ("", "world", "default")


def register_group(name: str, group: "dist.ProcessGroup") -> None:
    """Make `group_ep=name` refer to `group` in this process."""
    if not isinstance(name, str):
        raise TypeError(f"register_group: argument 'name': expected a str, got {type(name).__name__}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"register_group: argument 'group': expected a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    _REGISTERED[name] = group


def group_ep_name(op: str, group_ep: Union[str, "dist.ProcessGroup"]) -> str:
    """The `group_ep` string for a name or a ProcessGroup (registered under its c10d name)."""
    if isinstance(group_ep, str):
        return group_ep
    if dist.is_available() and isinstance(group_ep, dist.ProcessGroup):
        name = group_ep.group_name
        _REGISTERED[name] = group_ep
        return name
    raise TypeError(
        f"{op}: argument 'group_ep': expected a str (process group name) or a torch.distributed.ProcessGroup, "
        f"got {type(group_ep).__name__}"
    )


def find_group(name: str) -> Optional["dist.ProcessGroup"]:
    """The process group `name` refers to in this process (see the module docstring), or None."""
    group = _REGISTERED.get(name)
    if group is None and dist.is_available() and dist.is_initialized():
        if name in _WORLD_NAMES:
            group = dist.group.WORLD
        else:
            try:
                group = dist.distributed_c10d._resolve_process_group(name)
            except (RuntimeError, AttributeError, ValueError):
                group = None
    return group


def resolve_group(op: str, name: str, rank_size: int, rank_id: int, size_arg: str = "ep_rank_size",
                  rank_arg: str = "ep_rank_id") -> "dist.ProcessGroup":
    """The process group `name` for a collective of `rank_size` ranks in which this process is
    `rank_id`; raises ValueError if it cannot be found or disagrees with the given sizes (naming
    the op's arguments `size_arg` and `rank_arg`)."""
    group = find_group(name)
    if group is None:
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized:
            raise ValueError(
                f"{op}: argument 'group_ep': expected a process group for {size_arg} = {rank_size} ranks, got "
                f"{name!r} but torch.distributed is not initialized in this process: call "
                "torch.distributed.init_process_group(...) on every rank first (\"\" then names the default "
                "group), or pass a ProcessGroup"
                + ("; with ep_rank_size = 1 no process group is needed" if size_arg == "ep_rank_size" else "")
            )
        known = sorted(set(_REGISTERED) | {""})
        raise ValueError(
            f"{op}: argument 'group_ep': expected a process group, its ProcessGroup.group_name, a name given to "
            f"cam_jit.register_group, or \"\" for the default group (known here: {known}), got {name!r}"
        )
    size = dist.get_world_size(group)
    if size != rank_size:
        raise ValueError(
            f"{op}: argument '{size_arg}': expected {size} (the size of process group {name!r}), got {rank_size}"
        )
    rank = dist.get_rank(group)
    if rank != rank_id:
        raise ValueError(
            f"{op}: argument '{rank_arg}': expected {rank} (this process's rank in group {name!r}), got {rank_id}"
        )
    return group
