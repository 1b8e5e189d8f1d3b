"""An EventSink that records what a manager reports, for in-process tier tests."""

from __future__ import annotations


class RecordingSink:
    def __init__(self):
        self.events = []

    def blocks_stored(self, ns, hashes, medium, parent, tokens):
        self.events.append(("stored", medium, list(hashes)))

    def blocks_removed(self, ns, hashes, medium):
        self.events.append(("removed", medium, list(hashes)))

    def all_cleared(self, ns):
        self.events.append(("cleared", None, []))

    def hashes(self, kind, medium):
        """Every hash of the events of one kind ("stored"/"removed") and medium, in order."""
        return [h for k, m, hs in self.events if (k, m) == (kind, medium) for h in hs]
