"""The CLI, driven through argv on a tiny model saved next to the zoo tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_checkpoint
from specfx import zoo
from specfx.cli.main import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_checkpoint(path, layers=4, seed=2, eos=True)
    return path


def test_bench_json_has_every_field(checkpoint, tmp_path, capsys, monkeypatch):
    from specfx import matmul_choice

    timed = []                      # the draft and verify columns: every specfx method's parts in one round-robin
    monkeypatch.setattr(matmul_choice, "round_robin", lambda calls, repeats: timed.append(sorted(calls)) or
                        dict.fromkeys(calls, 1e-3))
    out = tmp_path / "bench.json"
    rc = main(["bench", str(checkpoint), "--methods", "hf-greedy,hf-early-exit:1,specfx:none,specfx:early-exit:2",
               "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
               "--backend", "eager", "-k", "3", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) == {"model", "device", "settings", "runs", "machine"}
    assert data["machine"]["samples"] == 3 and data["machine"]["stream_gbps"][1] > 0   # 2 prompts' rounds, then one more
    assert set(data["machine"]) == {"samples", "stream_mb", "stream_gbps", "fma_gflops", "ridge_rows", "handoff_ns"}
    names = [r["name"] for r in data["runs"]]
    assert names == ["hf-greedy", "hf-early-exit:1", "specfx:none", "specfx:early-exit:2"]
    for r in data["runs"]:
        for key in ("tokens_per_s", "ttft_s", "tpot_s", "mean_accepted", "acceptance_by_position", "draft_s",
                    "verify_s", "peak_mem_mb", "exact_match", "speedup_vs_hf_greedy"):
            assert key in r
        assert r["exact_match"] == 1.0 and r["tokens_per_s"] > 0
        # One repeat of 2 prompts: each prompt's time is its TTFT (their median is their mean)
        # and then its tokens after the first at TPOT each.
        after_first = r["tpot_s"] * (r["new_tokens"] - 2)
        assert after_first + 2 * r["ttft_s"] == pytest.approx(r["new_tokens"] / r["tokens_per_s"])
        assert r["tpot_s"] > 0
    ee = data["runs"][-1]
    assert len(ee["acceptance_by_position"]) == 3 and ee["draft_s"] > 0 and ee["verify_s"] > 0
    assert timed == [[(0, "decode"), (1, "draft"), (1, "verify")]]       # none, then early exit
    # each part timed as the calls a step makes of it in a row (k + 1 = 4 draft calls: 1 ms in all)
    assert data["runs"][2]["verify_s"] == 1e-3 and ee["draft_s"] == pytest.approx(1e-3)
    assert "vs hf-greedy" in capsys.readouterr().out


def test_bench_rejects_unknown_methods(checkpoint, capsys):
    assert main(["bench", str(checkpoint), "--methods", "specfx:medusa", "--num-prompts", "1",
                 "--backend", "eager"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_generate_streams_and_prints_stats(checkpoint, capsys):
    rc = main(["generate", str(checkpoint), "--prompt", "def f(x):", "--draft", "early-exit:2",
               "-k", "2", "--max-new-tokens", "6", "--max-seq-len", "64", "--backend", "eager"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "def f(x):" in out and "mean_accepted" in out and "ttft_s" in out


def test_sweep_picks_a_best_pair_and_saves_it(checkpoint, tmp_path):
    import shutil

    from specfx.cli.common import load_model
    from specfx.sweep import save_default, sweep_exit

    path = shutil.copytree(checkpoint, tmp_path / "copy")   # save_default edits config.json
    model, tok, path = load_model(str(path))
    result = sweep_exit(model, tok, zoo.prompts()[:1], max_new_tokens=6, num_prompts=1, ks=(3, 5), layers=[1, 3],
                        backend="eager", check=2, rounds=1, log=lambda m: None)
    # Every asked (exit layer, k), the last exit layer included; neither k is the model's 4.
    assert [(r["exit_layer"], r["k"]) for r in result.rows] == [(1, 3), (1, 5), (3, 3), (3, 5)]
    # The two best predicted pairs ran for real, and the sweet spot is the faster of them.
    checked = sorted(result.rows, key=lambda r: -r["predicted_speedup"])[:2]
    assert [r for r in result.rows if "measured_speedup" in r] == [r for r in result.rows if r in checked]
    assert result.best is max(checked, key=lambda r: r["measured_speedup"])
    assert all(r["step_ms"] > 0 and 1 <= r["tokens_per_step"] <= r["k"] + 1 for r in result.rows)
    save_default(path, result.best)
    model2, _, _ = load_model(str(path))
    import specfx

    fast = specfx.compile(model2, draft="early-exit", max_seq_len=32, backend="eager")
    assert fast.drafter.layer == result.best["exit_layer"]
    assert fast.num_speculative_tokens == result.best["k"]
    # The sweep's k is early exit's: the other drafters keep the model's.
    other = specfx.compile(model2, draft="ngram:2", max_seq_len=32, backend="eager").num_speculative_tokens
    assert other == (getattr(model.config, "specfx_num_speculative_tokens", None) or 4)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="exit layers must be in 1..3"):
        sweep_exit(model, tok, zoo.prompts()[:1], layers=[4], backend="eager", log=lambda m: None)


def test_sweep_tries_every_exit_layer_below_the_last_by_default(checkpoint, monkeypatch):
    """The rows of a sweep without `layers`; the builds and timings are stand-ins (the sweep
    above measures for real)."""
    from types import SimpleNamespace

    from specfx import sweep
    from specfx.cli.common import load_model

    monkeypatch.setattr(sweep, "_profiled", lambda *a: SimpleNamespace(profile=lambda: (1e-3, 2e-3)))
    monkeypatch.setattr(sweep, "_acceptance", lambda model, E, k, *a: [0.5] * k)
    # The real runs: the second best prediction runs fastest, and is picked.
    monkeypatch.setattr(sweep, "_run_side_by_side", lambda model, drafters, *a: [1.1, 1.3] + [1.0] * (len(drafters) - 2))
    model, tok, _ = load_model(str(checkpoint))
    result = sweep.sweep_exit(model, tok, zoo.prompts()[:1], max_new_tokens=6, num_prompts=1, ks=(3, 5),
                              backend="eager", log=lambda m: None)
    assert [(r["exit_layer"], r["k"]) for r in result.rows] == [(E, k) for E in (1, 2, 3) for k in (3, 5)]
    # (k=5 predicts more than k=3 here: the five best are every k=5, then E=1 and E=2 at k=3)
    measured = {(r["exit_layer"], r["k"]): r["measured_speedup"] for r in result.rows if "measured_speedup" in r}
    assert measured == {(1, 5): 1.1, (2, 5): 1.3, (3, 5): 1.0, (1, 3): 1.0, (2, 3): 1.0}
    assert (result.best["exit_layer"], result.best["k"]) == (2, 5)


@pytest.mark.parametrize("backend,skinny", [("inductor", True), ("eager", False)])
def test_sweeps_time_the_graphs_the_backend_builds(monkeypatch, backend, skinny):
    """The sweeps build eagerly and compile only the timed parts: the build must still get the
    matmul rewrite that `backend` gets (without it Inductor times BLAS matmuls)."""
    import specfx
    from specfx import sweep

    built = {}

    class Built:
        def generate(self, *a, **kw):
            pass

        runtime = type("R", (), {})()

    monkeypatch.setattr(specfx, "compile", lambda model, **kw: built.update(kw) or Built())
    sweep._profiled(torch.nn.Linear(2, 2), "none", 1, torch.ones(1, 2, dtype=torch.long), 64, backend)
    assert built["backend"] == "eager" and built["skinny_matmul"] is skinny


def test_tree_sweep_reports_every_shape_and_saves_the_best(checkpoint, tmp_path, capsys, monkeypatch):
    """`specfx bench --sweep-tree`: the chain and each tree shape of an MTP head, with tokens
    per call and predicted speed; the chain and the two shapes predicted fastest then run side
    by side, and the fastest of those by measurement is the best; --save-default stores it
    (none if the chain wins), which `MTPHead()` then drafts."""
    import shutil

    import specfx
    from specfx import sweep
    from specfx.cli.common import load_model
    from specfx.mtp import new_head, save_head

    ran = []

    def side_by_side(model, drafters, *args):      # the last checked (predicted slowest of them) runs fastest
        ran.append([d for d, _ in drafters])
        return [1.0 + 0.1 * i for i in range(len(drafters))]

    monkeypatch.setattr(sweep, "_run_side_by_side", side_by_side)
    together, profile_models = [], sweep.profile_models
    monkeypatch.setattr(sweep, "profile_models", lambda models: together.append(len(models)) or profile_models(models))

    path = shutil.copytree(checkpoint, tmp_path / "copy")   # --save-default edits config.json
    model, _, _ = load_model(str(path))
    head = save_head(new_head(model), tmp_path / "head", model)
    out = tmp_path / "sweep.json"
    rc = main(["bench", str(path), "--sweep-tree", "--sweep-draft", f"mtp:{head}", "--trees", "2x1,3x2,1x1x1",
               "--save-default", "-k", "2", "--num-prompts", "1", "--max-new-tokens", "6", "--backend", "eager",
               "--check", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["tree"] for r in rows] == [None, [2, 1], [3, 2], [1, 1, 1]] and [r["nodes"] for r in rows] == [2, 3, 5, 3]
    assert all(r["step_ms"] > 0 and r["tokens_per_call"] >= 1 for r in rows) and data["best"] in rows
    assert together == [5], "plain decoding, the chain and the 3 shapes were not timed together"
    assert rows[0]["verify_bound_vs_chain"] == 1.0
    for r in rows[1:]:          # tokens per verify ms against the chain's
        bound = r["tokens_per_call"] / r["verify_ms"] / (rows[0]["tokens_per_call"] / rows[0]["verify_ms"])
        assert r["verify_bound_vs_chain"] == pytest.approx(bound, rel=0.01)
    top = sorted(rows[1:], key=lambda r: -r["predicted_speedup"])[:2]
    assert len(ran) == 1 and len(ran[0]) == 3 and ran[0][0].endswith("tree=1x1")      # the chain, then the top two
    assert [r.get("measured_vs_chain") for r in [rows[0], *top]] == [1.0, 1.1, 1.2]
    assert data["best"] == top[1] and all("measured_speedup" not in r for r in rows[1:] if r not in top)
    printed = capsys.readouterr().out
    assert "tree sweep" in printed and "chain of 2" in printed and "chain of 3" in printed   # a deeper chain by its own length
    assert "bound vs chain" in printed
    saved = json.loads((path / "config.json").read_text()).get("specfx_mtp_tree")
    assert saved == data["best"]["tree"]
    # A later sweep runs the saved tree too, measured, even where it is predicted slowest, so
    # that saving replaces it only with a shape that ran faster (here it runs last of those
    # checked: the fastest).
    other = next(t for t in ("2x1", "3x2", "1x1x1") if t != "x".join(map(str, saved)))
    monkeypatch.setattr(sweep, "profile_models", lambda models: [(0.0, 1e-3), (1e-3, 1e-3), (1e-3, 1e-3), (1.0, 1.0)])
    rc = main(["bench", str(path), "--sweep-tree", "--sweep-draft", f"mtp:{head}", "--trees", other,
               "--save-default", "-k", "2", "--num-prompts", "1", "--max-new-tokens", "6", "--backend", "eager",
               "--check", "1", "--json", str(out)])
    again = json.loads(out.read_text())
    assert rc == 0 and [r["tree"] for r in again["rows"]] == [None, [int(b) for b in other.split("x")], saved]
    assert ran[-1][-1].endswith("tree=" + "x".join(map(str, saved))) and again["best"]["tree"] == saved
    # The saved tree (or a chosen one, where the chain won) is what MTPHead() drafts.
    json.dump({**json.loads((path / "config.json").read_text()), "specfx_mtp_tree": [2, 1]},
              open(path / "config.json", "w"))
    model2, _, _ = load_model(str(path))
    fast = specfx.compile(model2, draft=specfx.MTPHead(str(head)), max_seq_len=32, backend="eager")
    assert fast.graphs.tree == specfx.runtime.tree.Tree.spine((2, 1)) and fast.num_speculative_tokens == 2
    # A k asks for the chain of k (the default tree applies when neither is given); a tree named
    # in the draft and a k that disagrees with its depth are refused.
    chain = specfx.compile(model2, draft=specfx.MTPHead(str(head)), num_speculative_tokens=3, max_seq_len=32,
                           backend="eager")
    assert chain.graphs.tree == specfx.runtime.tree.Tree.spine((1, 1, 1)) and chain.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="disagrees"):
        specfx.compile(model2, draft=specfx.MTPHead(str(head), tree=(2, 1)), num_speculative_tokens=3, backend="eager")
    torch._dynamo.reset()


def test_inspect_reports_structure_passes_and_a_clean_step(checkpoint, tmp_path, capsys):
    out = tmp_path / "inspect.json"
    rc = main(["inspect", str(checkpoint), "--draft", "early-exit:2", "-k", "3", "--graph", "verify",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "StructureMap" in text and "store_draft_weights" in text and "def forward" in text
    data = json.loads(out.read_text())
    assert {"structure", "passes", "step"} <= set(data)
    assert data["structure"]["num_layers"] == 4
    assert data["step"]["host_syncs"] == [] and data["step"]["graph_breaks"] == 0
    rewrites = [p for p in data["passes"] if p["kind"] == "rewrite"]
    # On CPU the skinny-matmul rewrite runs on every graph and says what it rewrote or kept, and why.
    skinny = [p for p in rewrites if p["name"] == "skinny_matmul"]
    assert skinny and all(p["reason"].startswith(("rewrote", "kept")) and "M=" in p["reason"] for p in skinny)
    # The verify graph (4 rows) computes its rotary table once; graphs of one row or any width keep it inline.
    rotary = {p["graph"]: p for p in rewrites if p["name"] == "share_rotary"}
    assert rotary["verify"]["modified"] and rotary["verify"]["reason"].startswith("computed once")
    assert not rotary["prefill"]["modified"] and "not static" in rotary["prefill"]["reason"]
    rewrites = [p for p in rewrites if p["name"] not in ("skinny_matmul", "share_rotary")]
    # (and the drafts' copy of the layers before the exit and the lm_head in int8, which the tiled
    # kernel reads as stored; the verify pass then runs every layer: the only cut is the first
    # token's, after the last layer)
    assert {p["name"] for p in rewrites} == {"attach_early_exit", "truncate_at_exit", "store_draft_weights", "cut_at_exit",
                                             "drop_head", "share_kv_buffers", "inline_graph_calls", "tree_attention"}
    assert [p["graph"] for p in data["passes"] if p["name"] == "cut_at_exit"] == ["first"]
    assert all(p["modified"] for p in rewrites)
    for p in data["passes"]:
        assert set(p) >= {"name", "kind", "modified", "reason", "nodes_added", "nodes_removed", "ms"}


def test_passes_lists_every_pass(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in ("attach_early_exit", "cut_at_exit", "check_no_host_sync", "analysis", "rewrite"):
        assert name in out


def test_bench_sampling_mode(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(checkpoint), "--sample", "--temperature", "0.7", "--num-prompts", "2",
               "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--backend", "eager", "-k", "2",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == ["hf-sample", "specfx:none", "specfx:early-exit:1"]
    assert all(r["exact_match"] is None for r in data["runs"])
    assert data["runs"][0]["speedup_vs_hf_greedy"] == 1.0
    assert data["settings"]["sampling"]["temperature"] == 0.7


def test_bench_other_drafters_and_their_transformers_baselines(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(checkpoint), "--task", "editing", "--methods",
               "hf-greedy,hf-prompt-lookup,hf-assisted,specfx:ngram:2,specfx:draft-model",
               "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
               "--backend", "eager", "-k", "3", "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["hf-greedy", "hf-prompt-lookup:3", "hf-assisted:pycoder-draft",
                                         "specfx:ngram:2", "specfx:draft-model:pycoder-draft"]
    assert all(r["exact_match"] == 1.0 for r in runs)
    assert len(runs[-1]["acceptance_by_position"]) == 3


@pytest.mark.parametrize("draft", ["none", "early-exit:2", "ngram:2", "draft-model:pycoder-draft"])
def test_profile_times_the_parts_of_every_drafter(checkpoint, draft):
    """profile() times the graphs it names: a delay put into the verify (or decode) graph shows
    in verify_s and not in draft_s; one put into each draft graph shows in draft_s once per call."""
    import time

    import specfx
    from specfx.cli.common import load_model

    model, _, _ = load_model(str(checkpoint))
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=48, backend="eager")
    fast.generate(torch.randint(3, 90, (1, 5)), max_new_tokens=4, eos_token_id=[])
    DRAFT, VERIFY = 0.01, 0.6        # apart by more than a loaded machine moves an eager forward

    def delayed(forward, seconds):
        return lambda *args: (time.sleep(seconds), forward(*args))[1]

    for name, gm in fast.graphs.parts.items():
        gm.forward = delayed(gm.forward, VERIFY if name in ("verify", "decode") else DRAFT)
    draft_s, verify_s = fast.profile(repeats=3)
    calls = sum(fast.graphs.draft_calls.values())         # k + 1 for early exit (eager: the model's weights) and the draft model
    assert calls == (4 if draft in ("early-exit:2", "draft-model:pycoder-draft") else 0)
    assert verify_s >= VERIFY
    assert calls * DRAFT <= draft_s < VERIFY


def test_bench_interleaves_methods_in_a_new_order_for_each_prompt(checkpoint, monkeypatch):
    """Every repeat runs each prompt through every method, in a seeded order that changes, so a
    drift in the machine's speed reaches each method alike; warm-ups run before the first round.
    The machine's stream and FMA speeds are sampled between the rounds and printed under the table."""
    from specfx import bench
    from specfx.cli.common import load_model

    model, tok, _ = load_model(str(checkpoint))
    calls = []

    def fake_build(model, method, *args):
        def gen(ids):
            calls.append((method, ids.shape[1]))
            return [1, 2], 0.01, 0.001, None
        return bench._Method(method, method, gen)

    monkeypatch.setattr(bench, "_build", fake_build)
    prompts = ["def f(x):", "import os\nimport sys", "class A:\n    pass", "x = 1"]
    methods = ["hf-greedy", "hf-early-exit:1", "hf-prompt-lookup:2"]
    result = bench.run_bench(model, tok, prompts, methods, model_name="tiny", repeats=3, warmup=1, log=lambda m: None)
    assert [r.name for r in result.runs] == methods and all(r.exact_match == 1.0 for r in result.runs)
    widths = [tok(p, return_tensors="pt").input_ids.shape[1] for p in prompts]
    assert calls[:3] == [(m, widths[0]) for m in methods]                    # each method's warm-up
    timed = [calls[3 + 3 * i: 6 + 3 * i] for i in range(3 * len(prompts))]
    assert [{w for _, w in group} for group in timed] == [{w} for w in widths * 3]   # a prompt at a time
    assert all(sorted(m for m, _ in group) == sorted(methods) for group in timed)    # every method once
    assert len({tuple(m for m, _ in group) for group in timed}) > 1                   # in changing orders
    speed = result.machine                           # sampled before each prompt's round and after the last
    assert speed["samples"] == 3 * len(prompts) + 1 and speed["stream_mb"] > 0
    assert all(0 < lo <= mid <= hi for lo, mid, hi in (speed["stream_gbps"], speed["fma_gflops"], speed["ridge_rows"]))
    (s0, _, s2), (f0, _, f2) = speed["stream_gbps"], speed["fma_gflops"]
    assert 2 * f0 / s2 <= speed["ridge_rows"][0] and speed["ridge_rows"][2] <= 2 * f2 / s0
    caption = bench.render(result).caption
    assert f"FMA peak {speed['fma_gflops'][1]:.1f} GFLOP/s" in caption
    assert f"ridge {speed['ridge_rows'][1]:.1f} rows" in caption
    if torch.get_num_threads() >= 2:                 # where the threads sit: a round trip between two
        h0, h1, h2 = speed["handoff_ns"]
        assert 0 < h0 <= h1 <= h2
        assert f"and back in {h1:.0f} ns ({h0:.0f}-{h2:.0f})" in caption
    else:
        assert speed["handoff_ns"] is None and "and back" not in caption
