"""Counters of what the loader skipped, and why: every bad sample is counted by kind, never silently.

Kinds that lose a sample (they make up the corrupt rate checked against data.max_corrupt_rate):
  corrupt_image     image bytes PIL cannot decode (or a format other than JPEG/PNG/WebP)
  image_too_large   more pixels than data.max_image_pixels (decompression-bomb guard)
  no_image          a sample without an image member
  bad_label         .cls/.json missing, not an integer, or outside the manifest's class range
  lost_in_shard     samples the manifest promised from a shard that was missing or truncated
Shard and member events (not samples): missing_shard, truncated_tar, unsafe_member (.pyd/.pickle/
.pth/... never unpickled), unknown_member, oversized_member.
Balance: dropped_for_balance (quota reached), repeated_for_balance (a slot re-read its shards
because bad samples ate its slack). samples: good samples delivered. excluded: samples skipped
unread because data.exclude_keys lists their key (not bad: no part of the corrupt rate).
Infrastructure: remote_retries (a retried request to an http(s):// or s3:// store), counted
whenever it happens: a re-read (a resume's fast-forward, a further pass) makes requests of its own.
"""
from __future__ import annotations

from collections import Counter

BAD_KINDS = ("corrupt_image", "image_too_large", "no_image", "bad_label", "lost_in_shard")
ALWAYS_KINDS = ("remote_retries",)  # events of this process's own reading: never counted before


class Tally:
    """Counts since the last ``take()``; the worker ships that delta with each batch so the main
    process sums exactly what belongs to the batches it has yielded."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.bad_by_shard: Counter = Counter()
        self.enabled = True  # off while fast-forwarding on resume: those events were counted before

    def muted(self) -> "Tally":
        """A view of this tally that counts only ``ALWAYS_KINDS``: for a re-read whose data events
        were counted the first time (the same counters, so ``take()`` here ships them)."""
        view = Tally()
        view.counts, view.bad_by_shard, view.enabled = self.counts, self.bad_by_shard, False
        return view

    def add(self, kind: str, n: int = 1) -> None:
        if (self.enabled or kind in ALWAYS_KINDS) and n:
            self.counts[kind] += n

    def bad(self, kind: str, shard: str, n: int = 1) -> None:
        assert kind in BAD_KINDS, f"{kind!r} is not a sample-losing kind {BAD_KINDS}"
        if self.enabled and n:
            self.counts[kind] += n
            self.bad_by_shard[shard] += n

    def take(self) -> dict:
        delta = {"counts": dict(self.counts), "bad_by_shard": dict(self.bad_by_shard)}
        self.counts.clear()
        self.bad_by_shard.clear()
        return delta

