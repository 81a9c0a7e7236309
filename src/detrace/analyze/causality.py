"""Across ranks: which ranks the divergence arose on, and through which collective it reached the others.

Each rank's alignment reports its first divergence and, when that divergence is the output of a collective or a
recv whose inputs on the rank itself matched, the call (`Link`: group and group_seq, or peer). Such a rank is a
*receiver via* that call if a peer of that call sent different data into it: another member of the group whose
input to a collective of that group, at that group_seq or earlier, differed; or, for a recv, the peer whose
send differed. If every member's inputs matched, the collective itself produced different bits: that rank is an
origin. A member that was not compared (`--rank`, a rank window) cannot be ruled out, so it is assumed to be
the sender. Every other divergent rank is an origin: its bits changed before anything different reached it.
"""

from __future__ import annotations

import dataclasses
import heapq

from detrace.analyze.align import Link, RankOutcome
from detrace.analyze.diff_result import Divergence, RankResult
from detrace.errors import UsageError
from detrace.tracefile.selection import Window, parse_window


def _members(group: str) -> Window | None:
    try:
        return parse_window(group)
    except UsageError:
        return None


class _Senders:
    """Per process group, the two earliest divergent inputs (so "anyone but me" is one lookup)."""

    def __init__(self, outcomes: dict[int, RankOutcome]) -> None:
        self.outcomes = outcomes
        earliest: dict[str, list[tuple[int, int]]] = {}
        for outcome in outcomes.values():
            for group, seq in outcome.sent.items():
                earliest.setdefault(group, []).append((seq, outcome.rank))
        self.earliest = {group: heapq.nsmallest(2, pairs) for group, pairs in earliest.items()}

    def reached(self, rank: int, link: Link) -> bool:
        """Whether a peer of `link` sent different data into it (or may have: a peer that was not compared)."""
        if link.phase == "p2p":
            peer = self.outcomes.get(link.peer) if link.peer is not None else None
            return peer is None or rank in peer.sent_to
        members = _members(link.group) if link.group else None
        if members is None or not members.bounded:
            return True
        if any(m not in self.outcomes for m in members.expand() if m != rank):
            return True
        # mypy, ignored below: link.group is set here: without it `members` is None and we returned above
        for seq, sender in self.earliest.get(link.group, []):  # type: ignore[arg-type]
            if sender != rank:
                return link.group_seq is None or seq <= link.group_seq
        return False


def resolve(outcomes: list[RankOutcome]) -> tuple[list[RankResult], list[int], Divergence | None]:
    """RankResults (sorted by rank), the origin ranks in causal order, and the first divergence across ranks."""
    by_rank = {o.rank: o for o in outcomes}
    senders = _Senders(by_rank)
    results: list[RankResult] = []
    for outcome in sorted(outcomes, key=lambda o: o.rank):
        first, via = outcome.first, None
        if first is None:
            cause = "identical"
        elif first.kind == "missing":
            cause = "missing"
        elif outcome.link is not None and senders.reached(outcome.rank, outcome.link):
            cause, via = "receiver", str(outcome.link)
        else:
            cause = "origin"
            if outcome.link is not None:  # every member's inputs matched: the collective made the difference
                detail = {**first.detail, "inputs_matched_on_all_ranks": True}
                first = dataclasses.replace(first, origin=True, detail=detail)
        # mypy, ignored below: cause is one of the Cause literals assigned above
        results.append(RankResult(rank=outcome.rank, first=first, cause=cause, via=via, records=outcome.records,  # type: ignore[arg-type]
                                  numeric=outcome.numeric, structural=outcome.structural,
                                  unverified=outcome.unverified))
    # mypy, ignored below: an origin always has a first divergence
    origins = sorted((r for r in results if r.cause == "origin"), key=lambda r: r.first.order)  # type: ignore[union-attr]
    pool = origins or [r for r in results if r.first is not None]
    # mypy, ignored below: pool holds only ranks with a first divergence
    first = min((r.first for r in pool), key=lambda d: d.order, default=None)  # type: ignore[union-attr]
    return results, [r.rank for r in origins], first
