"""The static shape of a proposal: a tree of draft tokens hanging off the pending token.

A step verifies the pending token (row 0) and N draft nodes (rows 1..N) in one target pass.
`Tree(parents)` fixes, at compile time, each node's parent (-1: the pending token), so
everything derived from it is static: a node's depth, its position (`last + depth`), the KV slot
it writes (`last + row`: siblings share a position but never a slot), and which rows it sees
(the committed cache, its ancestors and itself). A chain of k drafts is `Tree.chain(k)`
(parents -1, 0, 1, ..., k-2): there row = depth, so slots equal positions and the accepted path
is always rows 0..n.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]           # node i's parent node, -1 for the pending token; parents[i] < i

    def __post_init__(self):
        bad = [i for i, p in enumerate(self.parents) if not -1 <= p < i]
        if bad:
            raise ValueError(f"a tree node's parent must be an earlier node or -1 (the pending token); "
                             f"nodes {bad} of {self.parents} are not")

    @classmethod
    def chain(cls, k: int) -> Tree:
        """k drafts, each the child of the one before."""
        return cls(tuple(range(-1, k - 1)))

    @classmethod
    def spine(cls, branching: tuple[int, ...]) -> Tree:
        """A drafter's top candidates at each depth: `branching[d]` children of the depth-d spine
        node (the pending token at d = 0), in rank order; the first of them, the drafter's top
        choice, is the spine node one level down. `spine((1,) * k)` is `chain(k)`.

        Drafting such a tree costs what drafting its spine does (one drafter pass per depth:
        only spine nodes are expanded), and it accepts a second-ranked candidate wherever the
        spine's is rejected."""
        if not branching or any(not isinstance(b, int) or b < 1 for b in branching):
            raise ValueError(f"tree branching must be one or more ints >= 1 per depth, got {branching!r}")
        parents, spine = [], -1
        for b in branching:
            first = len(parents)
            parents.extend([spine] * b)
            spine = first
        return cls(tuple(parents))

    @property
    def size(self) -> int:
        """N, the number of draft nodes (the verify pass reads N + 1 rows)."""
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.size - 1))

    @cached_property
    def branching(self) -> tuple[int, ...] | None:
        """Candidates per depth when this is a `spine` tree (chains included), else None."""
        counts = tuple(self.depths[1:].count(d) for d in range(1, self.depth + 1))
        return counts if not counts or Tree.spine(counts) == self else None

    def __str__(self) -> str:
        if self.is_chain:
            return f"chain of {self.size}"
        return "x".join(map(str, self.branching)) if self.branching else f"tree {self.parents}"

    @cached_property
    def row_parents(self) -> tuple[int, ...]:
        """The parent row of each node's row (row = node + 1; row 0 is the pending token)."""
        return tuple(p + 1 for p in self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each row: 0 for the pending token, the parent's plus one for a node."""
        d = [0]
        for p in self.row_parents:
            d.append(d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        """The longest path's number of drafts: the most a step can accept."""
        return max(self.depths)

    @cached_property
    def ancestors(self) -> tuple[tuple[bool, ...], ...]:
        """[N+1][N+1]: ancestors[r][a] iff row a is row r itself or one of its ancestors."""
        rows = [[False] * (self.size + 1) for _ in range(self.size + 1)]
        for r in range(self.size + 1):
            a = r
            while True:
                rows[r][a] = True
                if a == 0:
                    break
                a = self.row_parents[a - 1]
        return tuple(tuple(row) for row in rows)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """[N+1][depth+1]: the rows on the path from the pending token to row r, by depth, padded
        with r itself (so that a path past its end repeats its last row)."""
        out = []
        for r in range(self.size + 1):
            path = [a for a in range(self.size + 1) if self.ancestors[r][a]]   # by row = by depth
            out.append(tuple(path + [r] * (self.depth + 1 - len(path))))
        return tuple(out)

    def positions(self, last: torch.Tensor) -> torch.Tensor:
        """[B, N+1]: each row's position, `last` [B] plus its depth."""
        if self.is_chain:
            return self.slots(last)
        return last[:, None] + const(last, self.depths)

    def slots(self, last: torch.Tensor) -> torch.Tensor:
        """[B, N+1]: the KV slot each row writes, `last` plus its row (positions, for a chain)."""
        return last[:, None] + torch.arange(self.size + 1, device=last.device)

    def visibility(self, last: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[B, 1, N+1, seq_len] bool: row r sees the committed cache (slots < last) and the slots
        of its ancestors and itself (slot `last + a` for each such row a)."""
        slots = torch.arange(seq_len, device=last.device)                  # [S]
        rel = slots[None, :] - last[:, None]                               # [B, S]: slot - last
        if self.is_chain:       # row r's ancestors are rows 0..r: it sees the slots up to its position
            rows = torch.arange(self.size + 1, device=last.device)
            return (rel[:, None, :] <= rows[None, :, None])[:, None]
        committed = (rel < 0)[:, None, :]                                  # [B, 1, S]
        in_tree = (rel >= 0) & (rel <= self.size)                          # [B, S]
        seen = const(last, self.ancestors, torch.bool)[:, rel.clamp(0, self.size)]  # [N+1, B, S]
        return (committed | (in_tree[None] & seen).transpose(0, 1))[:, None]


def put_rows(buf: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """buf [B, S, ...] at `positions` [B, W] <- values [B, W, ...], in place. index_put_, not
    scatter_: Inductor writes a scatter_ into a copy of the whole buffer and copies it back
    (pycoder's MTP history: 2 x 1.3 MB a step, a fused kernel of ~200 us), an index_put_ in place."""
    rows = torch.arange(buf.shape[0], device=buf.device)[:, None]                     # [B, 1]
    torch.ops.aten.index_put_(buf, [rows, positions], values.to(buf.dtype))


def move_path_kv(kv: list, last: torch.Tensor, path: torch.Tensor, max_pos: int) -> None:
    """Move the accepted path's KV entries into their final slots, in place: in each buffer
    [B, H, S, D], slot `last + path[:, j]` (where row path[j] wrote) goes to `last + j`. The
    other rows' entries stay beyond the new length, masked, and later steps overwrite them."""
    rows = torch.arange(path.shape[0], device=path.device)[:, None]                    # [B, 1]
    src = (last[:, None] + path).clamp(max=max_pos)                                      # [B, D+1]
    dst = (last[:, None] + torch.arange(path.shape[1], device=path.device)).clamp(max=max_pos)
    for buf in kv:
        # index_put_ (not scatter_), so Inductor writes the few entries in place (see put_rows).
        torch.ops.aten.index_put_(buf, [rows, None, dst], buf[rows, :, src])


def const(like: torch.Tensor, values, dtype=torch.long) -> torch.Tensor:
    """A constant tensor on `like`'s device, made inside the step (a module buffer made at
    build time would stay on the CPU when the step runs elsewhere)."""
    return like.new_tensor(values, dtype=dtype)
