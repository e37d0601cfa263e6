"""tests/helpers/rtnetlink in-process (root only): a request the kernel refuses raises naming the request and
errno's name, deleting a link already gone is no error, and a named namespace is made, entered by a thread
and removed without leaving its file."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from tests.helpers.rtnetlink import NetlinkError, Rtnl, create_netns, in_netns, netns_path, remove_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="rtnetlink's changes and a namespace need root")


def test_a_refused_request_names_itself_and_its_errno() -> None:
    with Rtnl() as root, pytest.raises(NetlinkError, match=r"RTM_NEWLINK nosuch-flodl0: ENODEV") as refused:
        root.set_up("nosuch-flodl0", True)
    assert refused.value.errno == errno.ENODEV


def test_deleting_a_missing_link_is_no_error() -> None:
    with Rtnl() as root:
        root.delete("nosuch-flodl0")


def test_a_named_namespace_is_its_own_and_leaves_nothing() -> None:
    name = f"flodl-unit-{os.getpid():x}"
    create_netns(name)
    try:
        with pytest.raises(FileExistsError):
            create_netns(name)
        assert in_netns(name, lambda: sorted(n for _, n in socket.if_nameindex())) == ["lo"]
        with Rtnl(name) as inner:
            assert inner.ipv4_addresses() == []  # a new namespace's lo is down, without its address
            inner.set_up("lo", True)
            assert [str(a) for a in inner.ipv4_addresses()] == ["127.0.0.1"]
    finally:
        remove_netns(name)
    assert not netns_path(name).exists()
    remove_netns(name)  # removing again is no error
