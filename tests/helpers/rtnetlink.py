"""The few rtnetlink requests and namespace calls tests/helpers/netns needs, spoken directly to the kernel:
the GPU boxes have no `ip` (iproute2), pyroute2 or iptables, only root and util-linux's `nsenter`. Every
request asks for an ack and a refused one raises NetlinkError naming the request and errno's name. A named
namespace is a bind mount of a thread's own network namespace on /run/netns/NAME (where `ip netns` keeps
them, so `nsenter --net=` and `ip` both find it); a socket opened by a thread that entered a namespace stays
in it, so one socket configures the inside from this process without a fork. /run/netns is made if missing
but not turned into a shared mount of its own as iproute2 does: that only shows the names in other mount
namespaces, and `nsenter --net` enters none."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

NETNS_DIR = Path("/run/netns")

_T = TypeVar("_T")
_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_MS_BIND = 0x1000
_MNT_DETACH = 0x2

_RTM_NEWLINK, _RTM_DELLINK, _RTM_GETLINK, _RTM_NEWADDR, _RTM_GETADDR = 16, 17, 18, 20, 22
_NAMES = {16: "RTM_NEWLINK", 17: "RTM_DELLINK", 18: "RTM_GETLINK", 20: "RTM_NEWADDR", 22: "RTM_GETADDR"}
_F_REQUEST, _F_MULTI, _F_ACK, _F_DUMP, _F_EXCL, _F_CREATE = 0x1, 0x2, 0x4, 0x300, 0x200, 0x400
_MSG_ERROR, _MSG_DONE = 2, 3
_IFLA_IFNAME, _IFLA_MASTER, _IFLA_LINKINFO, _IFLA_NET_NS_FD = 3, 10, 18, 28
_IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_IFF_UP = 0x1

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_ATTR = struct.Struct("=HH")  # rtattr: length, type


class NetlinkError(OSError):
    """A request the kernel refused: `errno` is the negative ack's."""


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def create_netns(name: str) -> Path:
    """A new, empty network namespace kept alive by its file /run/netns/NAME (as `ip netns add` makes one),
    made by a thread that leaves this process's own namespace alone."""
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    path = netns_path(name)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))

    def make() -> None:
        _libc_call("unshare(CLONE_NEWNET)", _LIBC.unshare, _CLONE_NEWNET)
        own = b"/proc/thread-self/ns/net"
        _libc_call(f"bind mount on {path}", _LIBC.mount, own, bytes(path), None, _MS_BIND, None)

    try:
        _in_thread(make)
    except BaseException:
        path.unlink()
        raise
    return path


def remove_netns(name: str) -> None:
    """The namespace's file unmounted and gone (either may be already); a process still in the namespace
    keeps it alive, unnamed, until it ends."""
    path = netns_path(name)
    if _LIBC.umount2(bytes(path), _MNT_DETACH) and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        raise _os_error(f"unmount {path}")
    path.unlink(missing_ok=True)


def in_netns(name: str, work: Callable[[], _T]) -> _T:
    """`work`'s result, run by a thread that entered namespace `name` (a socket it opens stays in there)."""

    def entered() -> _T:
        with open(netns_path(name), "rb") as ns:
            _libc_call(f"setns({netns_path(name)})", _LIBC.setns, ns.fileno(), _CLONE_NEWNET)
        return work()

    return _in_thread(entered)


class Rtnl:
    """A route netlink socket of the root namespace, or of namespace `netns` (by name)."""

    def __init__(self, netns: str | None = None) -> None:
        self._seq = 0
        if netns is None:
            self._sock = _route_socket()
        else:
            self._sock = in_netns(netns, _route_socket)

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def add_veth(self, name: str, peer: str, peer_netns: str, master: int | None = None) -> None:
        """A veth pair: `name` here (enslaved to bridge index `master` if given), `peer` in `peer_netns`."""
        with open(netns_path(peer_netns), "rb") as ns:
            peer_attrs = (
                _IFINFO.pack(0, 0, 0, 0, 0)
                + _name(peer)
                + _attr(_IFLA_NET_NS_FD, struct.pack("=I", ns.fileno()))
            )
            info = _attr(_IFLA_INFO_KIND, b"veth") + _attr(
                _IFLA_INFO_DATA, _attr(_VETH_INFO_PEER, peer_attrs)
            )
            slave = _attr(_IFLA_MASTER, struct.pack("=I", master)) if master is not None else b""
            self._link(_RTM_NEWLINK, name, _attr(_IFLA_LINKINFO, info) + slave, create=True)

    def add_bridge(self, name: str) -> int:
        """A Linux bridge; its interface index."""
        self._link(_RTM_NEWLINK, name, _attr(_IFLA_LINKINFO, _attr(_IFLA_INFO_KIND, b"bridge")), create=True)
        return self.index(name)

    def add_addr(self, name: str, address: str, prefixlen: int) -> None:
        packed = ipaddress.IPv4Address(address).packed
        body = _IFADDR.pack(socket.AF_INET, prefixlen, 0, 0, self.index(name))
        body += _attr(_IFA_LOCAL, packed) + _attr(_IFA_ADDRESS, packed)
        self._request(_RTM_NEWADDR, _F_CREATE | _F_EXCL, body, f"{address}/{prefixlen} on {name}")

    def set_up(self, name: str, up: bool) -> None:
        self._link(_RTM_NEWLINK, name, up=up)

    def delete(self, name: str) -> None:
        """The link gone (a veth's peer with it); nothing if there was none."""
        try:
            self._link(_RTM_DELLINK, name)
        except NetlinkError as error:
            if error.errno != errno.ENODEV:
                raise

    def index(self, name: str) -> int:
        (reply,) = self._link(_RTM_GETLINK, name)
        return int(_IFINFO.unpack_from(reply)[2])

    def ipv4_addresses(self) -> list[ipaddress.IPv4Address]:
        """Every IPv4 address of this namespace's interfaces."""
        replies = self._request(_RTM_GETADDR, _F_DUMP, _IFADDR.pack(socket.AF_INET, 0, 0, 0, 0), "addresses")
        found = []
        for reply in replies:
            attrs = dict(_attrs(reply[_IFADDR.size :]))
            value = attrs.get(_IFA_LOCAL, attrs.get(_IFA_ADDRESS))
            if value is not None:
                found.append(ipaddress.IPv4Address(value))
        return found

    def _link(
        self, kind: int, name: str, attrs: bytes = b"", create: bool = False, up: bool | None = None
    ) -> list[bytes]:
        """A link request for `name`: made new (`create`), or its IFF_UP flag set or cleared (`up`)."""
        flags, change = (0, 0) if up is None else (_IFF_UP if up else 0, _IFF_UP)
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, flags, change) + _name(name) + attrs
        return self._request(kind, _F_CREATE | _F_EXCL if create else 0, body, name)

    def _request(self, kind: int, flags: int, body: bytes, what: str) -> list[bytes]:
        """The payloads the kernel answered the request with, read up to its ack (or a dump's end)."""
        self._seq += 1
        self._sock.send(
            _HEADER.pack(_HEADER.size + len(body), kind, _F_REQUEST | _F_ACK | flags, self._seq, 0) + body
        )
        replies: list[bytes] = []
        while True:
            data = self._sock.recv(1 << 16)
            offset = 0
            while offset < len(data):
                length, typ, _, seq, _ = _HEADER.unpack_from(data, offset)
                payload = data[offset + _HEADER.size : offset + length]
                offset += _aligned(length)
                if seq != self._seq:
                    continue
                if typ == _MSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code:
                        name = errno.errorcode.get(code, str(code))
                        raise NetlinkError(code, f"{_NAMES[kind]} {what}: {name} ({os.strerror(code)})")
                    return replies
                if typ == _MSG_DONE:
                    return replies
                replies.append(payload)


def _libc_call(what: str, call: Callable[..., int], *args: object) -> None:
    if call(*args) != 0:
        raise _os_error(what)


def _os_error(what: str) -> OSError:
    """The failed libc call's errno, by name."""
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")


def _in_thread(work: Callable[[], _T]) -> _T:
    """`work`'s result from a thread of its own, which may leave this process's namespace and then ends."""
    done: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=run, name="flodl-netns")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def _route_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    sock.bind((0, 0))
    return sock


def _aligned(length: int) -> int:
    return (length + 3) & ~3


def _attr(kind: int, value: bytes) -> bytes:
    length = _ATTR.size + len(value)
    return _ATTR.pack(length, kind) + value + bytes(_aligned(length) - length)


def _name(name: str) -> bytes:
    return _attr(_IFLA_IFNAME, name.encode() + b"\0")


def _attrs(data: bytes) -> list[tuple[int, bytes]]:
    found = []
    offset = 0
    while offset + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, offset)
        found.append((kind & 0x3FFF, data[offset + _ATTR.size : offset + length]))
        offset += _aligned(max(length, _ATTR.size))
    return found
