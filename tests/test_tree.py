"""Draft trees: the static shape (`runtime.tree.Tree`), tree acceptance, and a verify pass over a
tree with an explicit mask and slots, against chains along each of its paths."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from specfx.capture import StaticDecoder, kv_slots, position_mask
from specfx.runtime.accept import greedy_accept
from specfx.runtime.tree import Tree

# The pending token (row 0) has children a (row 1) and b (row 2); a has c (row 3); c has d (row 4).
TREE = Tree((-1, -1, 0, 2))


def test_chain_rows_sit_at_their_positions_and_see_up_to_them():
    last = torch.tensor([3, 9])
    chain = Tree.chain(3)
    assert chain.is_chain and chain.size == 3 and chain.depth == 3
    assert torch.equal(chain.positions(last), last[:, None] + torch.arange(4))
    assert torch.equal(chain.slots(last), chain.positions(last))
    expected = position_mask(chain.positions(last), 16, torch.float32) == 0
    assert torch.equal(chain.visibility(last, 16), expected)
    assert Tree.chain(0).size == 0 and Tree.chain(0).depth == 0


def test_tree_shape_positions_slots_and_visibility():
    assert not TREE.is_chain
    assert TREE.depths == (0, 1, 1, 2, 3) and TREE.depth == 3
    assert TREE.paths[4] == (0, 1, 3, 4) and TREE.paths[2] == (0, 2, 2, 2)
    last = torch.tensor([5])
    assert TREE.positions(last).tolist() == [[5, 6, 6, 7, 8]]
    assert TREE.slots(last).tolist() == [[5, 6, 7, 8, 9]]          # siblings a, b: one position, two slots
    seen = TREE.visibility(last, 12)[0, 0]                          # [rows, slots]
    committed = [True] * 5
    assert seen[:, :5].all()
    assert seen[0].tolist() == committed + [True, False, False, False, False, False, False]
    assert seen[2].tolist() == committed + [True, False, True, False, False, False, False]    # b: not a
    assert seen[4].tolist() == committed + [True, True, False, True, True, False, False]      # d: root, a, c, d


def test_a_parent_must_come_first():
    with pytest.raises(ValueError, match="earlier node"):
        Tree((-1, 2, 0))


def _reference_accept(tree: Tree, drafts: list[int], greedy: list[int]) -> tuple[int, list[int]]:
    """The deepest row whose path matches, first in row order: (n, the path's argmax tokens)."""
    best, best_depth = 0, 0
    for r in range(1, tree.size + 1):
        path = [a for a in range(tree.size + 1) if tree.ancestors[r][a]]
        ok = all(drafts[a - 1] == greedy[tree.row_parents[a - 1]] for a in path[1:])
        if ok and tree.depths[r] > best_depth:
            best, best_depth = r, tree.depths[r]
    path = list(tree.paths[best])
    return best_depth, [greedy[a] for a in path]


@pytest.mark.parametrize("tree", [TREE, Tree((-1, -1, -1, 0, 0, 1, 3)), Tree.chain(4)])
def test_greedy_tree_acceptance_takes_the_deepest_matching_path(tree):
    g = torch.Generator().manual_seed(0)
    B, V = 64, 3                                   # a small vocabulary: many partial matches
    logits = torch.randn(B, tree.size + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, tree.size), generator=g)
    emitted, n, path = greedy_accept(drafts, logits, tree)
    greedy = logits.argmax(-1)
    depths = set()
    for b in range(B):
        want_n, want_tokens = _reference_accept(tree, drafts[b].tolist(), greedy[b].tolist())
        assert n[b].item() == want_n
        assert emitted[b, : want_n + 1].tolist() == want_tokens[: want_n + 1]
        depths.add(want_n)
    assert len(depths) > 2                         # the case mix reaches several depths


def test_verifying_a_tree_equals_verifying_each_of_its_paths():
    """Tree rows with their slots and mask give the logits that a chain along each row's path
    gives: siblings share a position but neither sees the other's KV."""
    model = tiny_model("llama", layers=2, seed=3)
    prompt = torch.tensor([[5, 17, 42, 8, 23]])
    t, a, b, c, d = 11, 30, 31, 40, 50

    def prefilled():
        dec = StaticDecoder(model, 1, 32)
        with torch.no_grad():
            dec(prompt[:, :-1], torch.arange(4)[None], torch.zeros(32, dtype=torch.uint8))
        return dec

    last = torch.tensor([4])
    span = torch.zeros(32, dtype=torch.uint8)
    with torch.no_grad():
        tree_logits = prefilled()(torch.tensor([[t, a, b, c, d]]), TREE.positions(last), span,
                                  TREE.slots(last), TREE.visibility(last, kv_slots(32)))
        for rows in ([0, 1, 3, 4], [0, 2]):
            ids = torch.tensor([[t, a, b, c, d][r] for r in rows])[None]
            chain = prefilled()(ids, last[:, None] + torch.arange(len(rows)), span)
            torch.testing.assert_close(tree_logits[:, rows], chain, rtol=1e-4, atol=1e-4)
