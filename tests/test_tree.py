"""Draft trees: the static shape (`runtime.tree.Tree`), tree acceptance, a verify pass over a tree
with an explicit mask and slots against chains along each of its paths, and the tree drafters
(a draft model, an MTP head, early exit on stored weights) end to end: exact, accepting more
than their chains, sync-free, exported and loaded."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

import specfx
from helpers import ARCHS, assert_greedy_equal, hf_greedy, tiny_model
from specfx.bench import parse_method
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


def test_spine_trees():
    tree = Tree.spine((4, 2, 2, 1))
    assert tree.parents == (-1, -1, -1, -1, 0, 0, 4, 4, 6)      # each depth hangs off the one before's top
    assert (tree.size, tree.depth, tree.branching, str(tree)) == (9, 4, (4, 2, 2, 1), "4x2x2x1")
    assert Tree.spine((1, 1, 1)) == Tree.chain(3) and Tree.chain(3).branching == (1, 1, 1)
    assert Tree((-1, -1, 1)).branching is None                  # a node off a second-ranked one: no spine
    for bad in ((), (2, 0), (1.5,)):
        with pytest.raises(ValueError, match="one or more ints >= 1"):
            Tree.spine(bad)


def _noisy_copy(model, scale: float, seed: int):
    """The model with noise on every weight: a draft that agrees with it most of the time."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


def _exact_and_more_than_the_chain(model, chain, tree) -> None:
    """Greedy tokens of a chain of 3 and of a depth-3 tree equal the model's on three prompts,
    and the tree accepts more a call (unless the chain accepted every draft)."""
    g = torch.Generator().manual_seed(2)
    accepted = {"chain": [], "tree": []}
    for prompt_len in (1, 7, 70):
        ids = torch.randint(3, 32, (1, prompt_len), generator=g)
        ref = hf_greedy(model, ids, 24, eos_token_id=None)
        for name, fast in (("chain", chain), ("tree", tree)):
            assert_greedy_equal(model, fast.generate(ids, max_new_tokens=24, eos_token_id=[]), ref, prompt_len)
            accepted[name].append(fast.last_stats.mean_accepted)
    chain_all = sum(accepted["chain"]) == 3 * 4                  # every draft accepted: nothing to gain
    assert sum(accepted["tree"]) > sum(accepted["chain"]) > 3 or chain_all, accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_tree_is_exact_and_accepts_more_than_its_chain(arch):
    """A draft that is often right but not always: where its top choice is rejected, a
    second-ranked candidate is accepted (the accepted path's KV moved into place and the draft's
    own KV refilled along it), so the tree accepts more per call than the chain of the same
    depth, and every token is still the target's."""
    model = tiny_model(arch, layers=2, vocab=32, seed=zlib.crc32(arch.encode()) % 1000)
    draft = _noisy_copy(model, 0.2, seed=1)
    chain = specfx.compile(model, draft=specfx.DraftModel(draft), num_speculative_tokens=3, max_seq_len=96,
                           backend="eager")
    tree = specfx.compile(model, draft=specfx.DraftModel(draft, tree=(3, 2, 2)), max_seq_len=96, backend="eager")
    assert tree.num_speculative_tokens == 3 and tree.graphs.tree.size == 7
    _exact_and_more_than_the_chain(model, chain, tree)


def _quiet_tail(model, after: int):
    """`model` with the layers from `after` on writing a fifth of what they did into the
    residual stream: an exit at `after` agrees with the model often, not always."""
    with torch.no_grad():
        for layer in model.model.layers[after:]:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_early_exit_tree_is_exact_and_accepts_more_than_its_chain(arch):
    """Early exit on a stored copy of its layers drafts the exit's top candidates along the
    spine; the verify pass runs every layer over every node, and the accepted path's KV moves
    into place in both the early and the late layers. Exact, sync-free, and where the exit's top
    choice is rejected a second-ranked one is accepted."""
    from specfx.passes import find_host_syncs

    model = _quiet_tail(tiny_model(arch, layers=3, vocab=32, seed=5), 1)
    chain = specfx.compile(model, draft=specfx.EarlyExit(1, weights_dtype="int8"), num_speculative_tokens=3,
                           max_seq_len=96, backend="eager")
    tree = specfx.compile(model, draft="early-exit:1:tree=3x2x2:weights=int8", max_seq_len=96, backend="eager")
    assert tree.num_speculative_tokens == 3 and tree.graphs.tree.size == 7
    assert find_host_syncs(tree.graphs.step) == []
    _exact_and_more_than_the_chain(model, chain, tree)


def test_mtp_tree_is_exact_on_batched_rows(tmp_path):
    """The MTP head drafts along the spine and refills along the accepted path; rows of
    different lengths in one batch."""
    from specfx.mtp import new_head, save_head

    model = tiny_model("qwen2", layers=2, vocab=32, seed=4)
    head = save_head(new_head(model), tmp_path / "head", model)
    fast = specfx.compile(model, draft=specfx.MTPHead(head, tree=(2, 2)), batch_size=2, max_seq_len=64,
                          backend="eager")
    g = torch.Generator().manual_seed(5)
    for lengths in ((3, 9), (12, 1)):
        rows = [torch.randint(3, 32, (n,), generator=g) for n in lengths]
        width = max(lengths)
        ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
        mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]) for r in rows]).long()
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
        for b, r in enumerate(rows):
            ref = hf_greedy(model, r[None], 16, eos_token_id=None)
            assert_greedy_equal(model, out[b:b + 1, width - len(r):], ref, len(r))


def test_tree_step_is_one_graph_without_host_sync_and_round_trips_an_artifact(tmp_path):
    from specfx.passes import find_host_syncs

    model = tiny_model("llama", layers=2, vocab=32, seed=6)
    fast = specfx.compile(model, draft=specfx.DraftModel(_noisy_copy(model, 0.5, seed=2), tree=(2, 2)),
                          max_seq_len=48, backend="eager")
    g = fast.graphs
    g.state.load_prompts([torch.ones(3, dtype=torch.long)], 4, [])
    for step in (g.step, g.fused_sample_step()):          # greedy, and sampling over the tree
        assert find_host_syncs(step) == []
        # no library kernel (topk), which would keep every buffer of the compiled step on the heap
        assert not any("topk" in str(n.target) for n in step.graph.nodes)
        torch._dynamo.reset()
        explain = torch._dynamo.explain(step)(*g.state.step_args())
        assert explain.graph_break_count == 0 and explain.graph_count == 1
    fast.export(tmp_path / "art", formats=("pt2",))
    loaded = specfx.load(tmp_path / "art")
    assert loaded.manifest["tree"] == list(g.tree.parents)
    ids = torch.randint(3, 32, (1, 9))
    assert torch.equal(loaded.generate(ids, max_new_tokens=16, eos_token_id=[]),
                       fast.generate(ids, max_new_tokens=16, eos_token_id=[]))
    sampled = dict(max_new_tokens=16, do_sample=True, seed=3, eos_token_id=[])
    assert torch.equal(loaded.generate(ids, **sampled), fast.generate(ids, **sampled))


def test_tree_refusals(tmp_path):
    model = tiny_model("llama", layers=2, vocab=32, seed=7)
    draft = specfx.DraftModel(tiny_model("llama", layers=1, vocab=32, seed=8), tree=(2, 2))
    with pytest.raises(ValueError, match="the tree sets the drafts per step"):
        specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=48, backend="eager")
    for spec, message in (("mtp:tree=2x2:pycoder-mtp", "expected tree="), ("mtp:pycoder-mtptree=2", "tree goes last"),
                          ("early-exit:tree=2x2:1", "expected tree="), ("early-exit:1tree=2", "tree goes last")):
        with pytest.raises(ValueError, match=message):
            specfx.parse_draft(spec)
    # Early exit drafts a tree from stored weights only: the verify pass continues from the exit
    # hidden states of a chain of drafts on the model's own.
    spec = "early-exit:1:tree=2x2:weights=int8"
    assert specfx.parse_draft(spec) == specfx.EarlyExit(1, weights_dtype="int8", tree=(2, 2))
    assert str(specfx.parse_draft(spec)) == spec
    assert parse_method("specfx:early-exit:tree=3x2x2", 3, 3) == ("specfx:early-exit", "3:tree=3x2x2")   # the bench's
    with pytest.raises(ValueError, match="from a stored copy of its layers"):
        specfx.EarlyExit(1, weights_dtype="target", tree=(2, 2))
    with pytest.raises(ValueError, match="from a stored copy of its layers"):    # no tiled kernel: the model's weights
        specfx.compile(model, draft=specfx.EarlyExit(1, tree=(2, 2)), max_seq_len=48, backend="eager",
                       skinny_matmul=False)


def test_draft_model_kv_holds_the_accepted_tokens_after_tree_steps():
    """Where a second-ranked candidate was accepted, the draft's KV at that position holds the
    spine's token until the refill rewrites it along the accepted path: after generating, the
    draft's cache equals a fresh prefill of the draft over the tokens kept."""
    model = tiny_model("mistral", layers=2, vocab=32, seed=11)
    draft = _noisy_copy(model, 0.2, seed=1)
    fast = specfx.compile(model, draft=specfx.DraftModel(draft, tree=(3, 2, 2)), max_seq_len=96, backend="eager")
    fast.generate(torch.randint(3, 32, (1, 9), generator=torch.Generator().manual_seed(3)), max_new_tokens=30,
                  eos_token_id=[])
    st = fast.graphs.state
    n = int(st.lengths[0]) - 1                                   # tokens in the cache (the last is pending)
    ref = StaticDecoder(draft, 1, st.seq_len)
    with torch.no_grad():
        ref(st.tokens[:, :n], torch.arange(n)[None], torch.zeros(st.seq_len, dtype=torch.uint8))
    ours = fast.graphs.kv_layout.take(st.kv, "draft")
    theirs = [t for i in range(draft.config.num_hidden_layers) for t in ref.kv(i)]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a[:, :, :n], b[:, :, :n], rtol=1e-4, atol=1e-4)


def test_inspect_reports_and_draws_the_tree():
    from rich.console import Console

    from specfx.cli.inspect_cmd import _draw_tree
    from specfx.inspect import inspect_model

    model = tiny_model("llama", layers=2, vocab=32, seed=12)
    draft = specfx.DraftModel(tiny_model("llama", layers=1, vocab=32, seed=13), tree=(3, 2))
    report = inspect_model(model, draft, k=4, max_seq_len=32, skinny_matmul=False)
    assert report.k == 2 and report.tree == [-1, -1, -1, 0, 0]
    assert report.to_dict()["tree"] == report.tree and report.step.host_syncs == []
    console = Console(width=100, record=True)
    console.print(_draw_tree(report.tree))
    text = console.export_text()
    assert "5 nodes" in text and text.count("depth 2") == 2 and "candidate 3" in text
