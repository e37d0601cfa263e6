"""A network namespace of its own for one process of a test, linked to the root namespace by a veth pair
whose link can be taken down and brought back up: a network partition of that process (the fault harness's
`partition` kind, tests/helpers/chaos.py). Taking the host end down drops every packet either way without a
firewall (this box has no iptables, nft or tc netem); the sockets stay open, so a process whose link comes
back finds its connections as it left them. Root only (`ip netns`, `ip link`)."""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import subprocess
from dataclasses import dataclass

_MADE = itertools.count()


@dataclass(frozen=True)
class Link:
    """A namespace `netns` reached from the root namespace at `host_addr` (on `host_if`); the process in it
    has `ns_addr` (on `ns_if`)."""

    netns: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str

    def inside(self) -> list[str]:
        """The prefix of a command that runs it in the namespace."""
        return ["ip", "netns", "exec", self.netns]

    def down(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def up(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def remove(self) -> None:
        """The veth pair and the namespace gone (either may be already); a process still in the namespace
        keeps it alive, unnamed, until it ends."""
        subprocess.run(["ip", "link", "del", self.host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], check=False, capture_output=True)


def make_link() -> Link:
    """A fresh namespace and veth pair, named uniquely for this process, on a /24 of 10.0.0.0/8 no interface
    of the root namespace has; the caller removes it (Link.remove), which this does itself if it fails
    halfway."""
    if os.geteuid() != 0:
        raise PermissionError("a network namespace needs root")
    tag = f"{os.getpid():x}x{next(_MADE)}"
    net = _free_net()
    hosts = list(itertools.islice(net.hosts(), 2))
    link = Link(f"flodl-{tag}", f"fh{tag}", f"fn{tag}", str(hosts[0]), str(hosts[1]))
    try:
        _ip("netns", "add", link.netns)
        _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if, "netns", link.netns)
        _ip("addr", "add", f"{link.host_addr}/{net.prefixlen}", "dev", link.host_if)
        _ip("link", "set", link.host_if, "up")
        for command in (
            ["addr", "add", f"{link.ns_addr}/{net.prefixlen}", "dev", link.ns_if],
            ["link", "set", link.ns_if, "up"],
            ["link", "set", "lo", "up"],
        ):
            _ip("-n", link.netns, *command)
    except BaseException:
        link.remove()
        raise
    return link


def _free_net() -> ipaddress.IPv4Network:
    taken = subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True, text=True).stdout
    while True:
        net = ipaddress.IPv4Network(f"10.{random.randint(100, 254)}.{random.randint(0, 255)}.0/24")
        if not any(ipaddress.IPv4Address(word.split("/")[0]) in net for word in _addresses(taken)):
            return net


def _addresses(ip_output: str) -> list[str]:
    words = ip_output.split()
    return [words[i + 1] for i, word in enumerate(words) if word == "inet"]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
