"""Ranks started apart (no flodl supervisor to reap them): each holds a TCP connection to the run's host for
its whole life, and the kernel closes it the moment the process ends, however it ends (SIGKILL, the OOM
killer, a crash). The host posts that end as a supervisor would (membership.post_exit), so the coordinator
cuts the rank at once instead of at `heartbeat_timeout_s`. A frozen or cut-off rank keeps its connection
open: the heartbeat finds those. A rank that ends as planned (the run's end, a stop) says so first.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

from torch.distributed import Store

from flodl.links.membership import post_exit

# Where the host listens (its port), in the store's root.
_PORT = "flodl/liveness"
_BYE = b"bye\n"


class LivenessListener(threading.Thread):
    """The host's side: accepts each rank's connection (`<rank> <incarnation>\\n` first) and posts the exit of
    one that closes without a bye."""

    def __init__(self, store: Store, address: str) -> None:
        super().__init__(name="flodl-liveness", daemon=True)
        self.store = store
        self.server = socket.create_server((address, 0))
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        self._said: dict[socket.socket, bytes] = {}
        self._ending = threading.Event()
        store.set(_PORT, str(self.server.getsockname()[1]))

    def run(self) -> None:
        while not self._ending.is_set():
            for key, _ in self.selector.select(timeout=0.2):
                if key.fileobj is self.server:
                    conn, _ = self.server.accept()
                    self._said[conn] = b""
                    self.selector.register(conn, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(256)
        except OSError:
            data = b""
        if data:
            self._said[conn] += data
            return
        said = self._said.pop(conn)
        self.selector.unregister(conn)
        conn.close()
        hello, newline, rest = said.partition(b"\n")
        if not newline or rest.endswith(_BYE):  # no rank's, or it ended as planned
            return
        rank, incarnation = (int(word) for word in hello.split())
        post_exit(self.store, rank, incarnation, "its connection to the run's host closed")

    def wait_quiet(self, timeout_s: float) -> None:
        """Until every rank connected has ended (its connection closed), at most `timeout_s`: the run's host
        outlives its ranks, whose last reads of the store would fail once it is gone."""
        deadline = time.monotonic() + timeout_s
        while self.connected() and time.monotonic() < deadline:
            time.sleep(0.05)

    def connected(self) -> int:
        """How many ranks hold a connection (said who they are, not ended yet)."""
        return sum(1 for said in list(self._said.values()) if said)

    def stop(self) -> None:
        self._ending.set()
        self.join()
        for conn in list(self._said):
            conn.close()
        self.server.close()


class Liveness:
    """A rank's side: the connection, opened once the rank knows its incarnation, held until it ends."""

    def __init__(self, conn: socket.socket, rank: int, incarnation: int) -> None:
        self.conn = conn
        self.conn.sendall(f"{rank} {incarnation}\n".encode())

    @classmethod
    def to_host(cls, store: Store, host: str, rank: int, incarnation: int) -> Liveness | None:
        """Connected to the run's host if it listens (flodl-coordinator does, from before any rank can reach
        it; a self-launch supervisor reaps its ranks itself and does not)."""
        if not store.check([_PORT]):
            return None
        return cls(socket.create_connection((host, int(store.get(_PORT)))), rank, incarnation)

    def bye(self) -> None:
        """This process ends as planned: its end is no death."""
        self.conn.sendall(_BYE)

    def close(self) -> None:
        self.conn.close()
