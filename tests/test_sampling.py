"""Exact speculative sampling: hand-built edge cases, the output distribution, end to end."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.passes import find_host_syncs
from specfx.runtime.sampling import (TOP_K_CAP, filters_for, race, race_top, speculative_accept, top_indices,
                                     tree_speculative_accept, warp)
from specfx.runtime.tree import Tree


def _onehot(tokens, V):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_all_drafts_accepted_gives_k_plus_one_tokens():
    V, k = 5, 3
    drafts = torch.tensor([[1, 2, 3]])
    q = _onehot([1, 2, 3], V)[None]
    p = _onehot([1, 2, 3, 4], V)[None]                     # target certain of the drafts, bonus 4
    emitted, n = speculative_accept(drafts, q, p, torch.rand(1, k), torch.ones(1, V))
    assert n.tolist() == [3] and emitted.tolist() == [[1, 2, 3, 4]]


def test_first_draft_rejected_resamples_from_the_residual():
    V = 4
    drafts = torch.tensor([[0, 1]])
    q = torch.tensor([[[0.9, 0.1, 0.0, 0.0], [0.25] * 4]])
    p = torch.tensor([[[0.1, 0.0, 0.9, 0.0], [0.25] * 4, [0.25] * 4]])
    emitted, n = speculative_accept(drafts, q, p, torch.tensor([[0.5, 0.0]]), torch.ones(1, V))
    # p(0)/q(0) = 1/9 < 0.5: rejected; residual max(p - q, 0) is all on token 2.
    assert n.tolist() == [0] and emitted[0, 0].item() == 2


def test_rejection_at_position_i():
    V, k = 6, 4
    drafts = torch.tensor([[1, 2, 3, 4]])
    q = _onehot([1, 2, 3, 4], V)[None]
    p = _onehot([1, 2, 5, 0, 0], V)[None]                  # position 2 wants 5, not 3
    emitted, n = speculative_accept(drafts, q, p, torch.rand(1, k), torch.ones(1, V))
    assert n.tolist() == [2] and emitted[0, :3].tolist() == [1, 2, 5]


def test_draft_equal_to_target_accepts_everything_without_nan():
    torch.manual_seed(0)
    V, k, B = 8, 3, 64
    p = torch.softmax(torch.randn(B, k + 1, V), -1)
    q = p[:, :k].clone()
    drafts = race(q, torch.empty(B, k, V).exponential_())
    emitted, n = speculative_accept(drafts, q, p, torch.rand(B, k), torch.empty(B, V).exponential_())
    assert (n == k).all() and not torch.isnan(emitted.float()).any()
    # Exactly zero residual with a forced rejection (u > 1) must fall back to p, not NaN.
    emitted, n = speculative_accept(drafts, q, p, torch.full((B, k), 2.0), torch.ones(B, V))
    assert (n == 0).all() and ((emitted[:, 0] >= 0) & (emitted[:, 0] < V)).all()


def test_disjoint_supports_accept_nothing():
    V, k = 6, 2
    q = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0]] * k])
    p = torch.tensor([[[0, 0, 0.5, 0.5, 0, 0]] * (k + 1)])
    drafts = torch.tensor([[0, 1]])
    emitted, n = speculative_accept(drafts, q, p, torch.zeros(1, k), torch.ones(1, V))
    assert n.tolist() == [0] and emitted[0, 0].item() in (2, 3)


def _emitted_tv(N, k=3, V=10, seed=0, accept_always=False):
    """Total variation between the empirical distribution of each emitted position and p."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(1, k + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, k, V, generator=g) * 1.5, -1)
    P, Q = p.expand(N, -1, -1), q.expand(N, -1, -1)
    drafts = race(Q, torch.empty(N, k, V).exponential_(generator=g))
    u = torch.zeros(N, k) if accept_always else torch.rand(N, k, generator=g)
    emitted, n = speculative_accept(drafts, Q, P, u, torch.empty(N, V).exponential_(generator=g))
    tvs = []
    for j in range(k + 1):
        rows = n >= j                                      # position j was emitted
        counts = torch.bincount(emitted[rows, j], minlength=V).float()
        tvs.append(0.5 * (counts / counts.sum() - p[0, j]).abs().sum().item())
    return tvs


def test_rejection_sampling_keeps_the_target_distribution():
    small = _emitted_tv(1_000)
    large = _emitted_tv(100_000)
    assert max(large[:3]) < 0.01                          # position 3 is emitted less often
    assert large[3] < 0.02
    # The error shrinks like 1/sqrt(N): 100x the samples, about 10x less (allow 4x).
    assert sum(large) < sum(small) / 4
    # A deliberately wrong sampler (accept every draft) fails the same test.
    assert max(_emitted_tv(100_000, accept_always=True)) > 0.05


def _tree_tv(N, branching, V=4, seed=0, with_replacement=False, accept_all=False) -> float:
    """Total variation between the first D+1 tokens (D = the tree's depth) and their exact joint
    law under a random target, when a step over a spine tree emits n+1 of them and the rest
    come straight from the target (as later steps would draw them)."""
    g = torch.Generator().manual_seed(seed)
    D = len(branching)
    exp = lambda *shape: torch.empty(*shape).exponential_(generator=g)          # noqa: E731
    # The target's p(. | prefix) and the drafter's q(. | spine prefix), by prefix (index in base V).
    P = [torch.softmax(torch.randn(V ** d, V, generator=g) * 1.5, -1) for d in range(D + 1)]
    Q = [torch.softmax(torch.randn(V ** d, V, generator=g) * 1.5, -1) for d in range(D)]
    Q[0][:, -1] = 0                     # q's support (3 tokens) runs out before a width of 3 does
    Q[0] /= Q[0].sum(-1, keepdim=True)

    def index(tokens):
        i = torch.zeros(N, dtype=torch.long)
        for t in tokens:
            i = i * V + t
        return i

    drafts, qs, spine = [], [], []
    for d, width in enumerate(branching):
        q = Q[d][index(spine)]
        cand = torch.stack([race(q, exp(N, V)) for _ in range(width)], 1) if with_replacement \
            else race_top(q, exp(N, V), width)
        drafts.append(cand)
        qs.append(q)
        spine.append(cand[:, 0])
    drafts = torch.cat(drafts, 1)                                               # [N, nodes]
    tree = Tree.spine(branching)
    p = torch.stack([P[len(path) - 1][index([drafts[:, r - 1] for r in path[1:]])]
                     for path in ([a for a in range(tree.size + 1) if tree.ancestors[r][a]]
                                  for r in range(tree.size + 1))], 1)          # [N, nodes + 1, V]
    u = torch.zeros(N, tree.size) if accept_all else torch.rand(N, tree.size, generator=g)
    emitted, n, path = tree_speculative_accept(drafts, torch.stack(qs, 1), p, u, exp(N, V), branching)
    assert torch.equal(path[:, 0], torch.zeros(N, dtype=torch.long)) and (n <= D).all()
    tokens = []
    for j in range(D + 1):
        tokens.append(torch.where(j <= n, emitted[:, j], race(P[j][index(tokens)], exp(N, V))))
    counts = torch.bincount(index(tokens), minlength=V ** (D + 1)).float()
    exact = torch.ones(1)
    for d in range(D + 1):              # joint law: p(x0) p(x1 | x0) ... as a table over V^(D+1)
        exact = (exact[:, None] * P[d]).reshape(-1)
    return 0.5 * (counts / N - exact).abs().sum().item()


@pytest.mark.parametrize("branching", [(3, 2), (2, 1, 2), (1, 3)])
def test_tree_rejection_sampling_keeps_the_target_distribution(branching, monkeypatch):
    """Recursive rejection over siblings drawn without replacement keeps the target's joint law
    of the next D+1 tokens (draws with replacement too: a repeated draw is skipped); accepting
    every draft, or judging a sibling against p instead of the residual, does not."""
    from specfx.runtime import sampling

    small, large = _tree_tv(20_000, branching), _tree_tv(200_000, branching)
    assert large < 0.02, large          # sampling noise over 64-256 cells at N = 200k: about 0.01
    assert large < small / 1.5          # and it shrinks with N (1/sqrt(10) expected)
    assert _tree_tv(200_000, branching, with_replacement=True) < 0.02
    assert _tree_tv(200_000, branching, accept_all=True) > 0.1
    monkeypatch.setattr(sampling, "_residual", lambda p, q: p)
    assert _tree_tv(200_000, branching) > 0.03


def test_warp_matches_transformers_logits_processors():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    torch.manual_seed(0)
    x = torch.randn(3, 50) * 3
    for T, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.7, 0, 0.9), (1.3, 10, 0.8), (0.5, 1, 0.5)]:
        y = TemperatureLogitsWarper(T)(None, x.clone())
        y = TopKLogitsWarper(k)(None, y) if k else y
        y = TopPLogitsWarper(p)(None, y) if p < 1 else y
        torch.testing.assert_close(warp(x, T, k, p), y.softmax(-1))


@pytest.mark.parametrize("V", [200, 4096])
def test_warp_variants_compute_the_same_distribution(V):
    """Each variant `filters_for` picks equals the variant exact for every setting, ties and
    tiny top-p included (the cheap ones run when the host knows the settings allow them)."""
    torch.manual_seed(V)
    x = torch.randn(2, 3, V) * 3
    x[0, 0, :8] = x[0, 0].max()                              # ties at the top, and at the k-th
    x[1, 2, 100:140] = x[1, 2].topk(5).values[-1]
    for k, p in [(0, 1.0), (1, 1.0), (5, 1.0), (50, 1.0), (TOP_K_CAP, 1.0), (5, 0.9), (50, 0.5), (50, 1e-6),
                 (0, 0.9), (100, 0.8)]:
        filters = filters_for(k, p, V)
        assert filters == ("temperature" if (k, p) == (0, 1.0) else "top_k" if 1 <= k <= TOP_K_CAP else "any")
        ref = warp(x, 0.8, k, p)
        torch.testing.assert_close(warp(x, 0.8, k, p, filters=filters), ref, atol=1e-6, rtol=0)
    assert filters_for(50, 1.0, TOP_K_CAP) == "any"           # a vocabulary no larger than the cap


def test_the_runtime_runs_the_cheapest_exact_warp():
    model = tiny_model("llama", layers=2, vocab=96, seed=3)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=2, max_seq_len=48, backend="eager")
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    for kw, filters in [(dict(top_k=0, top_p=1.0), "temperature"), (dict(top_k=50), "top_k"),
                        (dict(top_k=0, top_p=0.9), "any")]:
        fast.generate(ids, max_new_tokens=8, do_sample=True, seed=0, eos_token_id=[], **kw)
        assert fast.runtime.filters == filters and filters in fast.graphs.sample_steps
    assert set(fast.graphs.sample_steps) == {"temperature", "top_k", "any"}


V_SMALL = 16


def _exact_two_token_marginals(model, prompt, T, top_k=0, top_p=1.0):
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], T, top_k, top_p)                   # [V]
        ext = torch.cat([prompt.expand(V_SMALL, -1), torch.arange(V_SMALL)[:, None]], 1)
        p2_given = warp(model(ext).logits[:, -1], T, top_k, top_p)                # [V, V]
    return p1, (p1[:, None] * p2_given).sum(0)


def _first_two_tv(model, draft, k, tmp_path, top_k: int = 0, top_p: float = 1.0,
                  tree: tuple[int, ...] | None = None) -> tuple[float, float]:
    """Total variation between the sampled distribution of the first two new tokens (4096 draws)
    and their exact marginals under the model (`tree`: a drafter's spine tree)."""
    if draft == "draft-model":
        draft = specfx.DraftModel(tiny_model("llama", layers=1, vocab=V_SMALL, seed=6), tree=tree)
    if draft == "early-exit":                             # a stored copy of layer 0: it drafts trees too
        draft = specfx.EarlyExit(1, weights_dtype="int8", tree=tree)
    if draft == "mtp":
        from specfx.mtp import new_head, save_head

        draft = specfx.MTPHead(save_head(new_head(model), tmp_path / "head", model), tree=tree)
    if draft in ("eagle", "eagle3", "deepseek-mtp"):       # a head in a published layout
        from specfx.heads import new_layout_head, write_layout

        extra = dict(draft_vocab_size=12, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]})
        head = new_layout_head(model, draft, **(extra if draft == "eagle3" else {}))
        draft = specfx.MTPHead(write_layout(head, tmp_path / draft, model, draft))
    B, runs, T = 512, 8, 0.9
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=32, batch_size=B,
                          backend="eager")
    prompt = torch.tensor([[3, 7, 5, 9]])
    counts1, counts2 = torch.zeros(V_SMALL), torch.zeros(V_SMALL)
    for r in range(runs):
        out = fast.generate(prompt.expand(B, -1), max_new_tokens=2, do_sample=True, temperature=T,
                            top_k=top_k, top_p=top_p, seed=r, eos_token_id=[])
        counts1 += torch.bincount(out[:, 4], minlength=V_SMALL)
        counts2 += torch.bincount(out[:, 5], minlength=V_SMALL)
    p1, p2 = _exact_two_token_marginals(model, prompt, T, top_k, top_p)
    # Spread out: a sampler stuck on the top token would be off by 1 - max(p) > 0.4 in TV.
    assert p1.max() < 0.6 and p2.max() < 0.6, (p1.max(), p2.max())
    N = B * runs
    return 0.5 * (counts1 / N - p1).abs().sum().item(), 0.5 * (counts2 / N - p2).abs().sum().item()


@pytest.mark.parametrize("draft,k", [("none", 1), ("early-exit:1", 3), ("early-exit:2", 2), ("ngram:1", 3),
                                     ("draft-model", 2), ("mtp", 2), ("eagle", 2), ("eagle3", 2),
                                     ("deepseek-mtp", 2)])
def test_end_to_end_distribution_of_the_first_two_tokens(tmp_path, draft, k):
    tv1, tv2 = _first_two_tv(tiny_model("llama", layers=3, vocab=V_SMALL, seed=4), draft, k, tmp_path)
    # Sampling noise alone gives TV ~ 0.02 at N = 4096 over 16 tokens; 0.05 leaves margin.
    assert tv1 < 0.05 and tv2 < 0.05, (tv1, tv2)


@pytest.mark.parametrize("draft,tree", [("mtp", (3, 2)), ("draft-model", (2, 2)), ("early-exit", (2, 2))])
def test_end_to_end_distribution_over_a_draft_tree(tmp_path, draft, tree):
    """Sampling over a spine tree (siblings drawn without replacement, recursive rejection)
    keeps the model's distribution of the first two new tokens."""
    tv1, tv2 = _first_two_tv(tiny_model("llama", layers=3, vocab=V_SMALL, seed=4), draft, len(tree), tmp_path,
                             tree=tree)
    assert tv1 < 0.05 and tv2 < 0.05, (tv1, tv2)


def test_distribution_with_top_k_and_top_p(tmp_path):
    """The same end-to-end test with both filters on (the warp variant exact for every setting)."""
    tv1, tv2 = _first_two_tv(tiny_model("llama", layers=3, vocab=V_SMALL, seed=4), "mtp", 2, tmp_path,
                             top_k=8, top_p=0.9)
    assert tv1 < 0.05 and tv2 < 0.05, (tv1, tv2)


def test_a_wrong_sampler_fails_the_distribution_test(tmp_path, monkeypatch):
    """Accepting every draft (the draft's distribution, not the model's) is caught by the same TV bound."""
    from specfx.runtime import step

    real = step.speculative_accept
    monkeypatch.setattr(step, "speculative_accept",
                        lambda drafts, q, p, uniforms, noise: real(drafts, q, p, uniforms * 0, noise))
    tv1, tv2 = _first_two_tv(tiny_model("llama", layers=3, vocab=V_SMALL, seed=4), "early-exit:1", 3, tmp_path)
    assert max(tv1, tv2) > 0.05, (tv1, tv2)


def test_same_seed_same_tokens_different_seed_different_tokens():
    model = tiny_model("llama", layers=4, vocab=64, seed=9)
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64, backend="eager")
    ids = torch.randint(3, 64, (1, 6))
    run = lambda seed: fast.generate(ids, max_new_tokens=24, do_sample=True, temperature=1.0, seed=seed,  # noqa: E731
                                     eos_token_id=[])
    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_unset_top_k_is_transformers_default_not_off():
    """`do_sample=True` alone samples as `model.generate(do_sample=True)` does: top-k 50 where
    neither the call nor the generation_config sets it."""
    model = tiny_model("llama", layers=2, vocab=256, seed=3)
    model.generation_config.top_k = None
    fast = specfx.compile(model, draft="none", max_seq_len=64, backend="eager")
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(0))
    run = lambda **kw: fast.generate(ids, max_new_tokens=32, do_sample=True, seed=4, eos_token_id=[], **kw)  # noqa: E731
    assert torch.equal(run(), run(top_k=50))
    assert not torch.equal(run(), run(top_k=0))


def test_bad_sampling_settings_are_refused():
    model = tiny_model("llama", layers=4)
    fast = specfx.compile(model, draft="none", max_seq_len=32, backend="eager")
    ids = torch.ones(1, 3, dtype=torch.long)
    for kw, msg in [({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k")]:
        with pytest.raises(ValueError, match=msg):
            fast.generate(ids, max_new_tokens=2, do_sample=True, **kw)


@pytest.mark.slow
def test_sampling_step_has_no_host_sync_and_compiles_fullgraph():
    model = tiny_model("llama", layers=2, seed=2)      # as tests/test_compiled.py: shared kernels
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=200,
                          backend="inductor", warmup=False)
    step = fast.graphs.fused_sample_step()
    assert find_host_syncs(step) == []
    fast.graphs.state.load_prompts([torch.ones(3, dtype=torch.long)], 4, [])
    explain = torch._dynamo.explain(step)(*fast.graphs.state.step_args())
    assert explain.graph_break_count == 0
    # The compiled step samples the tokens the uncompiled one does from the same seed (Inductor
    # rounds differently; a flip would need a draw within ~1e-6 of a decision boundary), given
    # the same drafts: from the int8 copy of the exit's layers, as with the rewrite on.
    eager = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=200, backend="eager",
                           skinny_matmul=True)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    for seed in (0, 1):
        kw = dict(max_new_tokens=16, do_sample=True, temperature=1.0, seed=seed, eos_token_id=[])
        assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))
    # Sampling with top_k=1 is greedy: the model's own tokens.
    out = fast.generate(ids, max_new_tokens=16, do_sample=True, top_k=1, seed=0, eos_token_id=[])
    assert_greedy_equal(model, out, hf_greedy(model, ids, 16), 5)


def test_top_indices_are_topk_largest_first_without_a_library_call():
    """A tree's candidates (greedy: the top logits; sampling: draws without replacement) come
    from rounds of argmax, not `topk`: the same indices, largest first, equal values lower index
    first; and the compiled graph that takes them calls no library kernel."""
    torch.manual_seed(0)
    x = torch.randn(3, 50)
    assert torch.equal(top_indices(x, 4), x.topk(4, -1).indices)
    assert top_indices(torch.tensor([[0.0, 2.0, 1.0, 2.0, -float("inf")]]), 4).tolist() == [[1, 3, 2, 0]]
    gm = torch.fx.symbolic_trace(lambda x: top_indices(x, 4))
    assert not any("topk" in str(n.target) for n in gm.graph.nodes)
