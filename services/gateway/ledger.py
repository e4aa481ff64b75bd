"""What one gateway has in flight: a bounded number of admitted requests (beyond it the
client gets 429) and, per instance, the requests sent there and not yet seen leave it
(dispatch spreads a burst by these; a draining instance waits for them). Pure."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


class Overloaded(Exception):
    """The gateway holds as many requests as it admits."""


@dataclass
class Booking:
    """What one attempt of a request counts in the ledger, to be taken out exactly once."""

    ledger: Ledger
    worker: str
    decode: str
    tokens: int = 0  # prompt tokens the worker is reckoned to compute for it
    counted: bool = False  # out of the prefill instance's queue already
    settled: bool = False

    def prefilled(self) -> None:
        if not self.counted:
            (self.ledger.prefilling if self.decode else self.ledger.queued)[self.worker] -= 1
            self.ledger.pending[self.worker] -= self.tokens
        self.counted = True

    def settle(self) -> None:
        """The attempt is over (the request ended or moved): nothing of it stays counted."""
        if not self.settled:
            self.settled = True
            self.prefilled()
            self.ledger.decoding[self.decode or self.worker] -= 1


@dataclass
class Ticket:
    """An admitted request's slot; released once, however the request ends, with the
    booking of the instances it was dispatched to (if nothing settled that first)."""

    ledger: Ledger
    released: bool = False
    booking: Booking | None = None

    def release(self) -> None:
        if self.booking is not None:
            self.booking.settle()
        if not self.released:
            self.released = True
            self.ledger.admitted -= 1


@dataclass
class Ledger:
    admitted: int = 0
    prefilling: collections.Counter[str] = field(default_factory=collections.Counter)
    decoding: collections.Counter[str] = field(default_factory=collections.Counter)
    # of a colocated worker's requests (in `decoding` from dispatch on), those not yet past
    # their first token
    queued: collections.Counter[str] = field(default_factory=collections.Counter)
    # prompt tokens to compute of the requests a worker or prefill instance has not yet
    # seen past their first token (those its cache is reckoned to hold left out)
    pending: collections.Counter[str] = field(default_factory=collections.Counter)

    def admit(self, limit: int) -> Ticket:
        if self.admitted >= limit:
            raise Overloaded(f"{self.admitted} requests in flight (limit {limit})")
        self.admitted += 1
        return Ticket(self)

    def book(self, prefill: str, decode: str, tokens: int = 0) -> Booking:
        """A request goes to `prefill` (a colocated worker when `decode` is empty), which
        computes `tokens` of its prompt: counted from the moment it is dispatched, so the
        next request of a burst sees it."""
        (self.prefilling if decode else self.queued)[prefill] += 1
        self.decoding[decode or prefill] += 1
        self.pending[prefill] += tokens
        return Booking(self, prefill, decode, tokens)

    def forget_idle(self, written: dict[str, int]) -> None:
        """Drop instances with nothing in flight whose zero count was written out."""
        now = self.per_instance()
        for instance in [i for i, n in written.items() if n == 0 and now.get(i) == 0]:
            for counts in (self.prefilling, self.decoding, self.queued, self.pending):
                counts.pop(instance, None)

    def per_instance(self) -> dict[str, int]:
        """Requests in flight to each instance this gateway has ever sent to (zeros kept,
        so a count that fell to zero is written out too)."""
        total: collections.Counter[str] = collections.Counter()
        for counts in (self.prefilling, self.decoding):
            for instance, n in counts.items():
                total[instance] += n
        return dict(total)
