"""DDP communication hooks: `bf16_wire` under sync (each gradient bucket crosses the wire as bf16), and
survive's averaging over gloo (each bucket's all-reduce is waited for so that a cut group lets go of it; as
bf16 too under `bf16_wire`).

torch ships the bf16 idea for NCCL only; this one also runs on gloo, so CPU runs and tests take the same
path as GPUs. (No `from __future__ import annotations` here: DDP checks a hook's annotations as real
types.)
"""

import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.futures import Future


def bf16_gradient_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return reduced.then(decompress)


class SettledBuckets:
    """The state of `settled_gradient_hook`: the group, how its collectives are waited for (`settle`, which
    raises once the group is cut), the dtype the buckets cross the wire as (`sent_as`, None: their own; bf16
    under `bf16_wire`), and the buckets in flight, waited for in order on a thread that lives while there
    are any (backward goes on computing meanwhile, as with DDP's own hook)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        settle: Callable[[dist.Work], object],
        sent_as: torch.dtype | None = None,
    ) -> None:
        self.group, self.settle, self.sent_as = group, settle, sent_as
        self.size = group.size()
        self._lock = threading.Lock()
        self._pending: deque = deque()  # (work, bucket buffer, what was sent, future DDP waits on)
        self._draining = False

    def submit(self, work: dist.Work, buffer: torch.Tensor, sent: torch.Tensor, done: Future) -> None:
        with self._lock:
            self._pending.append((work, buffer, sent, done))
            if not self._draining:
                self._draining = True
                threading.Thread(target=self._drain, name="flodl-ddp-buckets", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._draining = False
                    return
                work, buffer, sent, done = self._pending.popleft()
            try:
                self.settle(work)
                if sent is not buffer:
                    buffer.copy_(sent)
                done.set_result(buffer)
            except Exception as err:  # raised from backward by `_raised` (the step failed with the group)
                done.set_result(err)


def settled_gradient_hook(state: SettledBuckets, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    sent = buffer if state.sent_as is None else buffer.to(state.sent_as)
    work: dist.Work | None = dist.all_reduce(sent.div_(state.size), group=state.group, async_op=True)
    assert work is not None  # async_op: torch hands back the work
    done: Future[torch.Tensor] = Future()
    state.submit(work, buffer, sent, done)
    return done.then(_raised)


def _raised(done: Future[torch.Tensor]) -> torch.Tensor:
    """An error raised here reaches DDP's backward as one (`Future.set_exception` only reaches Python's
    `wait`: DDP would read the exception as the bucket)."""
    outcome = done.value()
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
