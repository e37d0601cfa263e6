"""Network namespaces of their own for processes of a test, each linked to the root namespace by a veth pair
whose host end can be taken down and brought back up: a network partition of the processes inside (the fault
harness's `partition` kind, tests/helpers/chaos.py; many ranks at once with make_bridged). Taking the host
end down drops every packet either way without a firewall (the boxes have no iptables, nft or tc netem); the
sockets stay open, so a process whose link comes back finds its connections as it left them. Root only; no
`ip` binary needed (tests/helpers/rtnetlink speaks to the kernel itself), only util-linux's `nsenter` to run
a command inside."""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
from dataclasses import dataclass

from tests.helpers.rtnetlink import Rtnl, create_netns, netns_path, remove_netns

_MADE = itertools.count()
_IFNAMSIZ = 15  # the longest interface name the kernel takes


@dataclass(frozen=True)
class Member:
    """A namespace `netns` whose veth has `ns_addr` on `ns_if` inside and its other end, `port`, in the root
    namespace: taking `port` down cuts this namespace off alone."""

    netns: str
    port: str
    ns_if: str
    ns_addr: str

    def inside(self) -> list[str]:
        """The prefix of a command that runs it in the namespace."""
        return ["nsenter", f"--net={netns_path(self.netns)}"]

    def down(self) -> None:
        with Rtnl() as root:
            root.set_up(self.port, False)

    def up(self) -> None:
        with Rtnl() as root:
            root.set_up(self.port, True)

    def remove(self) -> None:
        """The veth pair and the namespace gone (either may be already); a process still in the namespace
        keeps it alive, unnamed, until it ends."""
        with Rtnl() as root:
            root.delete(self.port)
        remove_netns(self.netns)


@dataclass(frozen=True)
class Link(Member):
    """A namespace reached from the root namespace at `host_addr`, on the veth's host end `host_if`."""

    host_addr: str

    @property
    def host_if(self) -> str:
        return self.port


@dataclass(frozen=True)
class Bridged:
    """Namespaces on one /24 whose veths' host ends are ports of the bridge `host_if`, which holds
    `host_addr` (where processes of the root namespace listen: GLOO_SOCKET_IFNAME=host_if there,
    GLOO_SOCKET_IFNAME=member.ns_if inside member i); `members[i].down()` cuts namespace i off from the
    host and from the other namespaces alike."""

    host_if: str
    host_addr: str
    members: tuple[Member, ...]

    def remove(self) -> None:
        """Every member and the bridge gone (any may be already)."""
        for member in self.members:
            member.remove()
        with Rtnl() as root:
            root.delete(self.host_if)


def make_link() -> Link:
    """A fresh namespace and veth pair, named uniquely for this process, on a /24 of 10.0.0.0/8 no interface
    of the root namespace has; the caller removes it (Link.remove), which this does itself if it fails
    halfway."""
    net = _free_net()
    host, inner = (str(address) for address in itertools.islice(net.hosts(), 2))
    tag = _tag()
    link = Link(f"flodl-{tag}", f"fh{tag}", f"fn{tag}", inner, host)
    try:
        with Rtnl() as root:
            _connect(root, link, net.prefixlen, master=None)
            root.add_addr(link.host_if, host, net.prefixlen)
            root.set_up(link.host_if, True)
    except BaseException:
        link.remove()
        raise
    return link


def make_bridged(n: int) -> Bridged:
    """`n` fresh namespaces on one bridge (Bridged), all on a /24 of 10.0.0.0/8 no interface of the root
    namespace has: the bridge holds its first address, member i the (i + 2)th; the caller removes them
    (Bridged.remove), which this does itself if it fails halfway."""
    if not 1 <= n <= 253:
        raise ValueError(f"make_bridged: {n} namespaces, a /24 holds 1 to 253 beside the host")
    net = _free_net()
    addresses = [str(address) for address in itertools.islice(net.hosts(), n + 1)]
    members = []
    for address in addresses[1:]:
        tag = _tag()
        members.append(Member(f"flodl-{tag}", f"fh{tag}", f"fn{tag}", address))
    bridged = Bridged(f"fb{_tag()}", addresses[0], tuple(members))
    try:
        with Rtnl() as root:
            bridge = root.add_bridge(bridged.host_if)
            root.add_addr(bridged.host_if, bridged.host_addr, net.prefixlen)
            root.set_up(bridged.host_if, True)
            for member in members:
                _connect(root, member, net.prefixlen, master=bridge)
                root.set_up(member.port, True)
    except BaseException:
        bridged.remove()
        raise
    return bridged


def _connect(root: Rtnl, member: Member, prefixlen: int, master: int | None) -> None:
    """`member`'s namespace made and its veth's inner end configured: address, up, and `lo` up too."""
    create_netns(member.netns)
    root.add_veth(member.port, member.ns_if, member.netns, master)
    with Rtnl(member.netns) as inner:
        inner.add_addr(member.ns_if, member.ns_addr, prefixlen)
        inner.set_up(member.ns_if, True)
        inner.set_up("lo", True)


def _tag() -> str:
    """A name's part unique on this host: this process's id and a count, short enough for an interface."""
    tag = f"{os.getpid():x}x{next(_MADE):x}"
    assert len(f"fh{tag}") <= _IFNAMSIZ, tag
    return tag


def _free_net() -> ipaddress.IPv4Network:
    """A /24 for new namespaces; refused without root, before anything is made."""
    if os.geteuid() != 0:
        raise PermissionError("a network namespace needs root")
    with Rtnl() as root:
        taken = root.ipv4_addresses()
    while True:
        net = ipaddress.IPv4Network(f"10.{random.randint(100, 254)}.{random.randint(0, 255)}.0/24")
        if not any(address in net for address in taken):
            return net
