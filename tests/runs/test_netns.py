"""Network namespaces made without the `ip` binary (tests/helpers/netns, the GPU boxes have no iproute2):
a command run `inside()` a namespace reaches the host's address, a bridged namespace reaches another, a
member's `down()` cuts that namespace alone off and `up()` brings it back, and `remove()` leaves no
interface or namespace behind. Every connect is made by a process started in the namespace."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.netns import Member, make_bridged, make_link
from tests.helpers.procs import PYTHON, run
from tests.helpers.rtnetlink import in_netns, netns_path

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root"),
]

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as error:
    print("refused:", error)
"""
CUT_S = 1.0  # how long a connect to a cut namespace is given: any answer within it would be a leak
# A connect that must succeed is given long: a link just up may drop the first SYNs until the kernel's link
# watch runs (TCP sends them again); it costs nothing when it connects at once.
REACH_S = 20.0


@pytest.fixture(autouse=True)
def _no_ip_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH with `nsenter` alone: any use of `ip`, here or in a child, fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsenter = shutil.which("nsenter")
    assert nsenter, "util-linux's nsenter is needed"
    (bin_dir / "nsenter").symlink_to(nsenter)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert shutil.which("ip") is None


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


def listen(made: list[socket.socket], address: str, netns: str | None = None) -> int:
    """A listener on `address` (in namespace `netns`, else here); its port."""

    def open_one() -> socket.socket:
        sock = socket.create_server((address, 0))
        made.append(sock)
        return sock

    sock = in_netns(netns, open_one) if netns else open_one()
    return int(sock.getsockname()[1])


def connects(member: Member, address: str, port: int, cwd: Path, timeout_s: float) -> bool:
    done = run([*member.inside(), PYTHON, "-c", CONNECT, address, str(port), str(timeout_s)], cwd, 60).check()
    return done.out.startswith("connected")


def interfaces() -> set[str]:
    return {name for _, name in socket.if_nameindex()}


def test_a_link_cut_and_healed(tmp_path: Path, listeners: list[socket.socket]) -> None:
    link = make_link()
    try:
        port = listen(listeners, link.host_addr)
        assert connects(link, link.host_addr, port, tmp_path, REACH_S)
        link.down()
        assert not connects(link, link.host_addr, port, tmp_path, CUT_S)
        link.up()
        assert connects(link, link.host_addr, port, tmp_path, REACH_S)
    finally:
        link.remove()
    assert link.host_if not in interfaces()
    assert not netns_path(link.netns).exists()


def test_one_bridged_member_cut_alone(tmp_path: Path, listeners: list[socket.socket]) -> None:
    bridged = make_bridged(3)
    first, second, _ = bridged.members
    try:
        assert len({bridged.host_addr, *(member.ns_addr for member in bridged.members)}) == 4
        host = listen(listeners, bridged.host_addr)
        peer = listen(listeners, second.ns_addr, second.netns)
        assert connects(first, bridged.host_addr, host, tmp_path, REACH_S)
        assert connects(first, second.ns_addr, peer, tmp_path, REACH_S)
        second.down()
        assert not connects(first, second.ns_addr, peer, tmp_path, CUT_S)
        assert not connects(second, bridged.host_addr, host, tmp_path, CUT_S)
        assert connects(first, bridged.host_addr, host, tmp_path, REACH_S)
        second.up()
        assert connects(first, second.ns_addr, peer, tmp_path, REACH_S)
    finally:
        bridged.remove()
    names = {bridged.host_if, *(member.port for member in bridged.members)}
    assert not names & interfaces()
    assert not any(netns_path(member.netns).exists() for member in bridged.members)
