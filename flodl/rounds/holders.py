"""Who takes part in local SGD's windows and rounds, and what each holds untrained (pure).

Every rank the run starts with is a member until one is dropped (fault_tolerance=survive); the seats past them
take ranks that join later. A dropped rank's slices that it was handed and had not reported trained return to
a pool, in (epoch, offset) order, which the next windows hand out before the cursor; its trained slices stay
trained (and the start of a slice it reported as a round took its snapshot midway through it: async rounds
fire inside slices). A restarted rank admitted while a window or a round is in progress joins when the next
window opens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flodl.links.messages import EpochSlice


@dataclass
class Holders:
    # The seats: every rank the run may hold.
    world_size: int
    batch_size: int
    # Ranks 0..first_members-1 are members at the start (None: every seat).
    first_members: int | None = None
    # The ranks that get windows and take part in rounds.
    members: set[int] = field(init=False)
    # Ranks admitted during a window or a round: members once the next window opens.
    joining: set[int] = field(default_factory=set)
    # Per member: the slices handed out and not yet reported trained (what returns if it dies).
    handed: dict[int, list[EpochSlice]] = field(init=False)
    # Slices a dropped rank held untrained, in (epoch, offset) order: handed out before the cursor.
    returned: list[EpochSlice] = field(default_factory=list)
    # Per member: the batches it reported trained since it became one (a sharded group's step together).
    reported: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.members = set(range(self.world_size if self.first_members is None else self.first_members))
        self.handed = {r: [] for r in range(self.world_size)}
        self.reported = dict.fromkeys(range(self.world_size), 0)

    def open_window(self) -> list[int]:
        """The members of the window that opens now (those admitted since join it), in order."""
        self.members |= self.joining
        self.joining = set()
        return sorted(self.members)

    def hand(self, rank: int, slices: tuple[EpochSlice, ...]) -> None:
        self.handed[rank].extend(slices)

    def trained(self, rank: int, part: EpochSlice) -> bool:
        """The rank trained all of `part`: a slice it was handed, or the start of one (reported as a round
        took its snapshot midway through it; the rest stays held). False: the rank is no member (it was
        dropped and `part` returned for another rank to train), so the report must not count."""
        if rank not in self.members:
            return False
        handed = self.handed[rank]
        at = next((i for i, s in enumerate(handed) if (s.epoch, s.offset) == (part.epoch, part.offset)), None)
        if at is None or not 0 < part.size <= handed[at].size:
            raise ValueError(f"rank {rank} reported {part} trained, which it does not hold")
        held = handed.pop(at)
        if part.size < held.size:
            handed.insert(at, EpochSlice(held.epoch, held.offset + part.size, held.size - part.size))
        self.reported[rank] += part.size // self.batch_size
        return True

    def trained_in_step(self, ranks: list[int]) -> list[EpochSlice]:
        """A sharded group leaving together: its members stepped together (each step a collective of the
        group), so each trained as many batches as the one that reported most; the batches a member trained
        and had not reported (it died between its step and its report) are taken out of what it holds, so
        that they are not handed out again. They, in the order it trained them."""
        most = max(self.reported[r] for r in ranks)
        taken = []
        for rank in ranks:
            handed, n = self.handed[rank], most - self.reported[rank]
            while n > 0 and handed:
                head = handed.pop(0)
                size = min(n * self.batch_size, head.size)
                taken.append(EpochSlice(head.epoch, head.offset, size))
                if size < head.size:
                    handed.insert(0, EpochSlice(head.epoch, head.offset + size, head.size - size))
                n -= size // self.batch_size
            self.reported[rank] = most
        return taken

    def admit(self, rank: int, busy: bool) -> None:
        """A restarted rank (nothing queued): a member at once, or when the next window opens if a window or
        round is in progress (`busy`: they are not its business)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        if rank in self.members or rank in self.joining:
            raise ValueError(f"rank {rank} is already a member")
        (self.joining if busy else self.members).add(rank)
        self.reported[rank] = 0

    def drop(self, rank: int) -> bool:
        """The rank is gone: what it held untrained returns to the pool. False: it was admitted and gone
        before its first window (it held nothing, and no window or round waited for it)."""
        if rank in self.joining:
            self.joining.discard(rank)
            return False
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a member (members: {sorted(self.members)})")
        if self.members == {rank}:
            raise RuntimeError(f"rank {rank} was the last member: no rank is left to train")
        self.members.discard(rank)
        self.returned = sorted([*self.returned, *self.handed[rank]], key=lambda s: (s.epoch, s.offset))
        self.handed[rank] = []
        return True

    def returned_batches(self, epoch: int | None = None) -> int:
        """Batches in the pool (of `epoch` only, unless None)."""
        return sum(s.size for s in self.returned if epoch in (None, s.epoch)) // self.batch_size

    def take_returned(self, n: int, epoch: int | None) -> tuple[EpochSlice, ...]:
        """Up to `n` batches of the pool, in order (of `epoch` only, unless None); a slice is split where `n`
        ends."""
        taken = []
        while n > 0 and self.returned and epoch in (None, self.returned[0].epoch):
            head = self.returned[0]
            size = min(n * self.batch_size, head.size)
            taken.append(EpochSlice(head.epoch, head.offset, size))
            if size == head.size:
                self.returned.pop(0)
            else:
                self.returned[0] = EpochSlice(head.epoch, head.offset + size, head.size - size)
            n -= size // self.batch_size
        return tuple(taken)
