"""Shared fixtures: tiny random-init models of several architectures, the zoo model."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist each worker has a core of its own; alone, the tests use up to two threads,
# or as many as OMP_NUM_THREADS says (two threads on a core that another process keeps busy
# run many times slower than one).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
elif not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(min(2, os.cpu_count() or 1))

# The skinny-matmul kernels named, not measured: a measurement compiles a timing graph per
# kernel and row count for every new weight set (most of a tiny model's compile), and its choice
# would vary with the machine. Both rewrites run: one-row graphs (decode, drafts) on Inductor's
# reduction, wider ones on the tiled kernel. tests/test_skinny_matmul.py covers the measurement.
os.environ.setdefault("SPECFX_MATMUL", "1:reduce,tiled")


def pytest_collection_modifyitems(config, items):
    """The slow tests (Inductor compiles, the embedded model) first, in their order: under
    pytest-xdist the workers then finish on short tests together, instead of one waiting out
    another's compile of a minute or two at the end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def pycoder():
    from specfx import zoo

    return zoo.load("pycoder")


@pytest.fixture(scope="session")
def pycoder_references(pycoder, tmp_path_factory):
    """(prompt ids, plain greedy `model.generate` output, 32 new tokens) for every evaluation
    prompt of the zoo model. Under pytest-xdist the workers share the work: each prompt's
    reference is one file in the run's shared temporary folder, written by the first worker to
    take its lock; a worker computes the prompts no other has taken, then waits for the rest."""
    from filelock import FileLock, Timeout

    from specfx import zoo

    model, tok = pycoder
    prompts = [tok(text, return_tensors="pt").input_ids for text in zoo.prompts("completion")]

    def reference(ids):
        with torch.no_grad():
            return ids, model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return [reference(ids) for ids in prompts]
    shared = tmp_path_factory.getbasetemp().parent                 # this run's, per worker above
    out = [None] * len(prompts)
    for wait in (False, True):                                     # the free prompts first
        for i, ids in enumerate(prompts):
            if out[i] is not None:
                continue
            path = shared / f"pycoder_reference_{i}.pt"
            try:
                with FileLock(f"{path}.lock", timeout=-1 if wait else 0):
                    if not path.is_file():
                        torch.save(reference(ids), path)
                    out[i] = torch.load(path)
            except Timeout:                                        # another worker computes it
                pass
    return out
