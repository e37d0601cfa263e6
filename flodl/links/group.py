"""Process-group set-up for one rank: environment, device, backend and config agreement."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.distributed import PrefixStore, Store, TCPStore

from flodl.config.host import RankEnv


def pick_device(wanted: str, local_rank: int) -> torch.device:
    """The rank's device for the `device` key (auto, cpu or cuda): the host's GPUs round-robin by
    LOCAL_RANK (more ranks than GPUs share them, over gloo: backend=cpu), unless on the CPU."""
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


@dataclass
class GroupHandle:
    """Where the rendezvous store lives (for mailboxes), the store this rank owns, if any, and the group's
    own key space in the store (for exchanges that must not unpickle what a peer sends)."""

    store_host: str
    store_port: int
    owned_store: TCPStore | None
    exchange: PrefixStore


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def loopback_store(port: int, world_size: int | None, timeout: timedelta) -> TCPStore:
    """A store server that listens on 127.0.0.1 only: torch's TCPStore binds every interface, so it is
    handed a socket bound here (`port` 0: a free one). `world_size`: the clients to wait for (None: none)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on (it closes it); the Python object must not.
    fd = listener.detach()
    return TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd)


_groups_started = 0


# The key space of a run whose store a process apart from its ranks hosts (fault_tolerance=survive: the
# supervisor, or flodl-coordinator): one run per store, whatever the ranks' processes count.
HOSTED_RUN = "flodl/run/"


def hosted_exchange(store: Store) -> PrefixStore:
    """The exchange of a run whose store this process hosts apart from the ranks (see `init_group`)."""
    return PrefixStore(f"{HOSTED_RUN}exchange/", store)


def bound_device(backend: str, device: torch.device) -> torch.device | None:
    """The GPU a world binds at its start (init_process_group's device_id): NCCL's, which starts its
    communicator at once and lets a device mesh split it. Not gloo's: a device mesh splits a bound gloo world
    by copying its options, which torch cannot (ranks sharing one GPU with sharded groups failed so: "cannot
    pickle '_Options' object")."""
    return device if backend == "nccl" and device.type == "cuda" else None


def init_group(
    env: RankEnv, backend: str, device: torch.device, timeout_s: float, hosted_apart: bool = False
) -> GroupHandle:
    """Join this job's process group. `hosted_apart` (fault_tolerance=survive): a process apart from the
    ranks hosts the store and the run (flodl/job/host.py), so no rank hosts it, and there is no WORLD group
    (the members average on groups of their own; a world with a dead member in it cannot be used or
    destroyed).

    Each group a process starts gets its own key prefix in the store: ranks that walk a multirun sweep
    together under one torchrun share one store, and a later job must never see an earlier job's keys.
    """
    global _groups_started
    timeout = timedelta(seconds=timeout_s)
    device_id = bound_device(backend, device)
    if env.launched:
        if env.master_addr is None or env.master_port is None:
            raise RuntimeError(
                "RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not: launch with torchrun"
            )
        host, port = env.master_addr, env.master_port
        # torchrun's agent hosts the store; otherwise rank 0 hosts it, as env:// would.
        hosts = not env.agent_store and env.rank == 0 and not hosted_apart
        if hosts and is_loopback(host):  # every rank is on this host: nobody else needs to reach it
            store = loopback_store(port, env.world_size, timeout)
        else:
            store = TCPStore(host, port, env.world_size, is_master=hosts, timeout=timeout)
        owned = store if hosts else None
    else:
        # A plain one-process run hosts its own store, so every code path has a group and mailboxes.
        store = loopback_store(0, 1, timeout)
        host, port, owned = "127.0.0.1", store.port, store
    _groups_started += 1
    # torchrun's agent store outlives a restart: a restarted group must not meet its predecessor's keys.
    prefix = HOSTED_RUN if hosted_apart else f"flodl/group/{env.restart_count}/{_groups_started}/"
    if not hosted_apart:
        dist.init_process_group(
            backend,
            store=PrefixStore(prefix, store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    return GroupHandle(host, port, owned, PrefixStore(f"{prefix}exchange/", store))


def publish_json(store: PrefixStore, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def read_json(store: PrefixStore, key: str) -> Any:
    """What a peer published under `key` (waits for it): plain JSON, never unpickled."""
    return json.loads(store.get(key).decode("utf-8"))


class ConfigMismatchError(RuntimeError):
    pass


def agree_on_config(config: dict[str, Any], rank: int, world_size: int, exchange: PrefixStore) -> None:
    """Check every rank composed the same config: each publishes its resolved config in the group's store,
    as JSON, and compares the others' with rank 0's."""
    text = yaml.safe_dump(config, sort_keys=True)
    publish_json(exchange, f"config/{rank}", text)
    gathered = [read_json(exchange, f"config/{other}") for other in range(world_size)]
    reference = gathered[0]
    for other, other_text in enumerate(gathered):
        if other_text != reference:
            raise ConfigMismatchError(
                f"rank {other} composed a different config than rank 0 "
                f"(sha256 {_digest(other_text)} vs {_digest(reference)}); differing keys: "
                + ", ".join(_differences(yaml.safe_load(reference), yaml.safe_load(other_text)))
                + ". Launch every rank with the same overrides and environment."
            )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


_ABSENT = "<absent>"


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}{k}.")]
    name = prefix.rstrip(".") or "<config>"
    return [] if a == b else [f"{name} (rank 0: {a!r}, other: {b!r})"]
