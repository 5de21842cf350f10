"""Union-find over item indices: the merge behind families of images (clearance's confirmed edges) and
of privacy units (patients, slides): one structure, so both merge the same way."""

from __future__ import annotations


class UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)  # smallest index is the root: first-listed member

    def connected(self, a: int, b: int) -> bool:
        return self.find(a) == self.find(b)
