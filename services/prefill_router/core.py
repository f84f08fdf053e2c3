"""PrefillRouterCore: length buckets, engines per bucket by quota share, pull under headroom.

Pure and synchronous, with an injectable clock (pass `now`, or leave it out and the core asks its
`clock`). The shell feeds it the prefill ranks it sees (`update_ranks`, from membership and
heartbeats) and the requests it receives (`submit`, with the hit length already known), and asks
it what to send now (`pump`). Vocabulary (docs/design/serving.md):

- rank: one prefill worker (one DP rank); group: a DP group of ranks, one engine. A rank names its
  group when it registers (see the shell); a rank without a group is a group of its own.
- bucket: requests by total input length (buckets.bucket_of). Each group serves one bucket at a
  time. Every round (`round_s`) the groups are re-dealt by each bucket's share of the compute
  quota that arrived in the last round that had any (buckets.engine_targets/reassign, moving as
  few groups as possible); every bucket with demand (last or current round, or a waiting request)
  keeps at least one group while there are enough. A bucket left without a group (more demanding
  buckets than groups) borrows the groups of the nearest bucket that has some, longer first.
- pull: each bucket has a bounded FIFO queue. A group has headroom while one of its ranks does:
  it accepts work, its estimated uncached tokens are below `rank_token_budget` and, when it
  reports a capacity, its estimated requests are below it. The oldest waiting request whose
  bucket has a group with headroom goes to the least-loaded such group (mean estimated tokens of
  its ranks), and inside it to the least-loaded rank with headroom. Nothing has headroom: the
  request waits; `expire` fails those that waited longer than `max_queue_wait_s`.
- estimates: a rank's load (uncached tokens, requests) is the larger of what its last heartbeat
  reported plus what the router handed it after that heartbeat arrived, and everything the router
  handed it and has not seen finished. A heartbeat that reports a rank idle settles work handed to
  it more than `idle_settle_s` before that heartbeat arrived (its PrefillDone was lost).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable

from messages.errors import InvalidRequest, Overloaded
from services.prefill_router.buckets import bucket_of, engine_targets, reassign
from services.prefill_router.policy import Outstanding, Queued, RankView, RouterPolicy, RouterStats

__all__ = ["Outstanding", "PrefillRouterCore", "Queued", "RankView", "RouterPolicy", "RouterStats"]


class PrefillRouterCore:
    def __init__(self, policy: RouterPolicy | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = policy or RouterPolicy()
        self.clock = clock
        self.stats = RouterStats()
        n = self.policy.buckets
        self.assignment: dict[str, int] = {}              # group -> bucket
        self._members: list[list[str]] = [[] for _ in range(n)]   # bucket -> its groups, sorted
        self._queues: list[deque[Queued]] = [deque() for _ in range(n)]
        self._queued_tokens = [0] * n
        self._queued: dict[str, Queued] = {}
        self._outstanding: dict[str, Outstanding] = {}
        self._work: dict[str, dict[str, Outstanding]] = {}   # rank -> request id -> outstanding
        self._work_tokens: dict[str, int] = {}
        self._ranks: dict[str, RankView] = {}
        self._by_group: dict[str, list[RankView]] = {}
        self._round_quota = [0.0] * n
        self._last_quota: list[float] | None = None
        self._round_started: float | None = None
        self._seq = 0

    # ---- ranks -------------------------------------------------------------------------
    def update_ranks(self, ranks: Iterable[RankView], now: float | None = None) -> list[Outstanding]:
        """Replace the view of the live ranks; returns work settled by idle heartbeats."""
        now = self._now(now)
        self._ranks = {r.instance: r for r in ranks}
        settled = []
        for rank in self._ranks.values():
            load = rank.load
            if load.in_flight or load.queue_depth or load.queued_tokens:
                continue
            for held in list(self._work.get(rank.instance, {}).values()):
                if held.dispatched_at < rank.seen_at - self.policy.idle_settle_s:
                    self._drop_outstanding(held)
                    settled.append(held)
        self.stats.settled += len(settled)
        self._regroup()
        self._roll(now)
        return settled

    def rank_dead(self, instance: str) -> list[Outstanding]:
        """Forget a dead rank; returns the work it held (to fail with PEER_DEAD)."""
        lost = list(self._work.get(instance, {}).values())
        for held in lost:
            self._drop_outstanding(held)
        self.stats.lost += len(lost)
        if self._ranks.pop(instance, None) is not None:
            self._regroup()
        return lost

    def rank_tokens(self, instance: str) -> int:
        """Estimated uncached tokens the rank holds (see "estimates" above)."""
        rank, work = self._ranks.get(instance), self._work.get(instance, {})
        if rank is None:
            return self._work_tokens.get(instance, 0)
        unseen = sum(h.item.uncached_tokens for h in work.values() if h.dispatched_at > rank.seen_at)
        return max(rank.load.queued_tokens + unseen, self._work_tokens.get(instance, 0))

    def rank_requests(self, instance: str) -> int:
        rank, work = self._ranks.get(instance), self._work.get(instance, {})
        if rank is None:
            return len(work)
        unseen = sum(1 for h in work.values() if h.dispatched_at > rank.seen_at)
        return max(rank.load.in_flight + unseen, len(work))

    def has_headroom(self, rank: RankView) -> bool:
        capacity = rank.load.capacity
        return (rank.accepts_work and self.rank_tokens(rank.instance) < self.policy.rank_token_budget
                and (capacity <= 0 or self.rank_requests(rank.instance) < capacity))

    # ---- requests ----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_tokens: int, hit_tokens: int = 0, payload: Any = None,
               now: float | None = None) -> Queued:
        """Queue a request in its bucket; raises InvalidRequest, or Overloaded when the bucket's
        queue is full. Its quota counts toward the bucket's demand even when refused."""
        if not request_id:
            raise InvalidRequest("a request needs a request id")
        if request_id in self._queued or request_id in self._outstanding:
            raise InvalidRequest(f"request {request_id} is already routed here", request_id=request_id)
        if prompt_tokens < 1 or not 0 <= hit_tokens <= prompt_tokens:
            raise InvalidRequest(f"bad lengths: prompt {prompt_tokens}, hit {hit_tokens}", request_id=request_id)
        now = self._now(now)
        self._roll(now)
        p = self.policy
        b = bucket_of(prompt_tokens, p.bucket_bounds)
        quota = p.quota(prompt_tokens, hit_tokens)
        self._round_quota[b] += quota
        self.stats.submitted += 1
        queue, uncached = self._queues[b], prompt_tokens - hit_tokens
        if len(queue) >= p.queue_limit or (queue and self._queued_tokens[b] + uncached > p.queue_token_limit):
            self.stats.refused += 1
            raise Overloaded(f"prefill bucket {b} is full ({len(queue)} requests, {self._queued_tokens[b]} "
                             f"tokens waiting)", request_id=request_id)
        self._seq += 1
        item = Queued(request_id, b, prompt_tokens, hit_tokens, quota, now, self._seq, payload)
        queue.append(item)
        self._queued_tokens[b] += uncached
        self._queued[request_id] = item
        if self._by_group and not self._members[b]:
            self._rebalance()     # demand appeared in a bucket without an engine
        return item

    def pump(self, now: float | None = None, admit: Callable[[Queued], Any] | None = None) -> list[Outstanding]:
        """Hand waiting requests to ranks with headroom, oldest first; returns the hand-outs.
        `admit(item)` is asked last for each one (the shell reserves its decode worker there): a
        None answer stops the pump with everything still waiting, as when no rank has headroom."""
        now = self._now(now)
        self._roll(now)
        handed: list[Outstanding] = []
        blocked: set[int] = set()
        while True:
            heads = [(q[0].seq, b) for b, q in enumerate(self._queues) if q and b not in blocked]
            if not heads:
                return handed
            _, b = min(heads)
            rank = self.pick_rank(b)
            if rank is None:
                blocked.add(b)
                continue
            admitted = admit(self._queues[b][0]) if admit is not None else True
            if admitted is None:
                return handed
            item = self._queues[b].popleft()
            self._queued_tokens[b] -= item.uncached_tokens
            del self._queued[item.request_id]
            held = Outstanding(item, rank.instance, rank.address, now, admitted)
            self._outstanding[item.request_id] = held
            self._work.setdefault(rank.instance, {})[item.request_id] = held
            self._work_tokens[rank.instance] = self._work_tokens.get(rank.instance, 0) + item.uncached_tokens
            self.stats.dispatched += 1
            handed.append(held)

    def pick_rank(self, bucket: int) -> RankView | None:
        """The least-loaded rank with headroom in the least-loaded group serving `bucket`."""
        best_key, best_ranks = None, None
        for group in self.groups_for(bucket):
            ranks = [r for r in self._by_group.get(group, ()) if r.accepts_work]
            free = [r for r in ranks if self.has_headroom(r)]
            if not free:
                continue
            key = (sum(self.rank_tokens(r.instance) for r in ranks) / len(ranks), group)
            if best_key is None or key < best_key:
                best_key, best_ranks = key, free
        if best_ranks is None:
            return None
        return min(best_ranks, key=lambda r: (self.rank_tokens(r.instance), self.rank_requests(r.instance),
                                              r.instance))

    def finish(self, request_id: str) -> Outstanding | None:
        """The rank is done with the request (PrefillDone, or its error); None if not held."""
        held = self._outstanding.get(request_id)
        if held is not None:
            self._drop_outstanding(held)
            self.stats.finished += 1
        return held

    def cancel(self, request_id: str) -> Queued | Outstanding | None:
        """Remove a request wherever it is (aborted, or could not be sent)."""
        item = self._queued.pop(request_id, None)
        if item is not None:
            self._queues[item.bucket].remove(item)
            self._queued_tokens[item.bucket] -= item.uncached_tokens
            self.stats.cancelled += 1
            return item
        held = self._outstanding.get(request_id)
        if held is not None:
            self._drop_outstanding(held)
            self.stats.cancelled += 1
        return held

    def drop_queued(self, predicate: Callable[[Queued], bool]) -> list[Queued]:
        """Cancel every waiting request the predicate selects (e.g. its gateway died)."""
        chosen = [item for item in self._queued.values() if predicate(item)]
        for item in chosen:
            self.cancel(item.request_id)
        return chosen

    def outstanding_where(self, predicate: Callable[[Queued], bool]) -> list[Outstanding]:
        """The handed-out requests whose item the predicate selects (left in place)."""
        return [held for held in self._outstanding.values() if predicate(held.item)]

    def expire(self, now: float | None = None) -> list[Queued]:
        """Remove and return the requests that waited longer than max_queue_wait_s."""
        now = self._now(now)
        limit = now - self.policy.max_queue_wait_s
        gone = []
        for b, queue in enumerate(self._queues):
            while queue and queue[0].enqueued_at <= limit:
                item = queue.popleft()
                self._queued_tokens[b] -= item.uncached_tokens
                del self._queued[item.request_id]
                gone.append(item)
        self.stats.expired += len(gone)
        return gone

    def holder(self, request_id: str) -> str | None:
        held = self._outstanding.get(request_id)
        return held.instance if held else None

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queued

    # ---- buckets and rounds ------------------------------------------------------------
    def groups_for(self, bucket: int) -> list[str]:
        """Groups serving `bucket`, or those of the nearest bucket with any (longer first)."""
        n = self.policy.buckets
        for distance in range(n):
            for b in (bucket + distance, bucket - distance):
                if 0 <= b < n and self._members[b]:
                    return self._members[b]
        return []

    def engines_per_bucket(self) -> list[int]:
        return [len(m) for m in self._members]

    def queue_lengths(self) -> list[int]:
        return [len(q) for q in self._queues]

    def quota_shares(self) -> list[float]:
        """Each bucket's share of the quota of the last round that had demand (zeros before one)."""
        last = self._last_quota or [0.0] * self.policy.buckets
        total = sum(last)
        return [q / total if total else 0.0 for q in last]

    def queued(self) -> int:
        return len(self._queued)

    def outstanding(self) -> int:
        return len(self._outstanding)

    def queued_tokens(self) -> int:
        return sum(self._queued_tokens)

    # ---- internals ---------------------------------------------------------------------
    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _roll(self, now: float) -> None:
        if self._round_started is None:
            self._round_started = now
            return
        elapsed = now - self._round_started
        if elapsed < self.policy.round_s:
            return
        self._round_started += (elapsed // self.policy.round_s) * self.policy.round_s
        if sum(self._round_quota) > 0:       # an idle round keeps the shares it found
            self._last_quota = self._round_quota
        self._round_quota = [0.0] * self.policy.buckets
        self.stats.rounds += 1
        self._rebalance()

    def _regroup(self) -> None:
        by_group: dict[str, list[RankView]] = {}
        for rank in sorted(self._ranks.values(), key=lambda r: r.instance):
            by_group.setdefault(rank.group, []).append(rank)
        by_group = {g: rs for g, rs in by_group.items() if any(r.accepts_work for r in rs)}
        changed = by_group.keys() != self._by_group.keys()
        self._by_group = by_group
        if changed:
            self._rebalance()

    def _rebalance(self) -> None:
        groups = sorted(self._by_group)
        if not groups:
            self._assign({})
            return
        current = self._round_quota
        weights = self._last_quota or (current if sum(current) > 0 else [0.0] * self.policy.buckets)
        demanding = [weights[b] > 0 or current[b] > 0 or bool(self._queues[b]) for b in range(self.policy.buckets)]
        targets = engine_targets(len(groups), weights, demanding)
        load = {g: float(sum(self.rank_tokens(r.instance) for r in rs)) for g, rs in self._by_group.items()}
        new = reassign(self.assignment, groups, targets, load)
        self.stats.moves += sum(1 for g, b in new.items() if self.assignment.get(g, b) != b)
        self._assign(new)

    def _assign(self, assignment: dict[str, int]) -> None:
        self.assignment = assignment
        self._members = [sorted(g for g, gb in assignment.items() if gb == b) for b in range(self.policy.buckets)]

    def _drop_outstanding(self, held: Outstanding) -> None:
        del self._outstanding[held.request_id]
        work = self._work.get(held.instance)
        if work is not None:
            work.pop(held.request_id, None)
            if not work:
                del self._work[held.instance]
        left = self._work_tokens.get(held.instance, 0) - held.item.uncached_tokens
        if left > 0:
            self._work_tokens[held.instance] = left
        else:
            self._work_tokens.pop(held.instance, None)
