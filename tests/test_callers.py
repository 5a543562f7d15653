"""One caller at a time: threads queue and each gets its exact answer; a call interrupted in
the middle (Ctrl-C, a failing streamer) leaves the model usable; a call from inside a call is
refused."""

from __future__ import annotations

import threading

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model

THREADS, TRIALS, NEW = 4, 3, 20


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4, seed=7)


@pytest.fixture(scope="module")
def fast(model):
    return specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64, backend="eager")


@pytest.fixture(scope="module")
def prompts(model):
    """(prompt, model.generate's greedy output) for each thread: different lengths and tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(THREADS):
        ids = torch.randint(3, 96, (1, 5 + 3 * i), generator=g)
        out.append((ids, hf_greedy(model, ids, NEW)))
    return out


def test_concurrent_callers_each_get_their_exact_answer(model, fast, prompts):
    for trial in range(TRIALS):
        outs, errors = [None] * THREADS, []
        start = threading.Barrier(THREADS)

        def call(i):
            try:
                start.wait()                  # all threads enter generate together
                outs[i] = fast.generate(prompts[i][0], max_new_tokens=NEW, eos_token_id=[])
            except BaseException as e:        # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for (ids, ref), out in zip(prompts, outs):
            assert_greedy_equal(model, out, ref, ids.shape[1])


class _Stop:
    """A streamer that raises `error` at its n-th `put` (the first put is the prompt)."""

    def __init__(self, error: BaseException, at: int):
        self.error, self.at, self.puts = error, at, 0

    def put(self, tokens):
        self.puts += 1
        if self.puts == self.at:
            raise self.error

    def end(self):
        pass


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("client went away")])
def test_an_interrupted_call_leaves_the_model_usable(model, fast, prompts, error):
    interrupted = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64,
                                 backend="eager", sync_every=2)
    (ids, _), (other, ref) = prompts[3], prompts[1]
    with pytest.raises(type(error)):
        interrupted.generate(ids, max_new_tokens=NEW, eos_token_id=[], streamer=_Stop(error, at=3))
    assert interrupted.graphs.state.done.logical_not().any()   # stopped mid-generation: rows were active
    assert_greedy_equal(model, interrupted.generate(other, max_new_tokens=NEW, eos_token_id=[]), ref,
                        other.shape[1])
    # Sampling after the interruption equals sampling on a model that was not interrupted.
    sample = dict(max_new_tokens=NEW, do_sample=True, seed=3, eos_token_id=[])
    assert torch.equal(interrupted.generate(other, **sample), fast.generate(other, **sample))


def test_ctrl_c_inside_a_step_leaves_the_model_usable(model, fast, prompts, monkeypatch):
    """KeyboardInterrupt raised from inside the third step, as Ctrl-C would."""
    (ids, _), (other, ref) = prompts[2], prompts[0]
    real, calls = fast.runtime.step_fn, []

    def step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(fast.runtime, "step_fn", step)
    with pytest.raises(KeyboardInterrupt):
        fast.generate(ids, max_new_tokens=NEW, eos_token_id=[])
    assert_greedy_equal(model, fast.generate(other, max_new_tokens=NEW, eos_token_id=[]), ref, other.shape[1])


def test_generate_from_inside_generate_is_refused(model, fast, prompts):
    ids, ref = prompts[0]

    class Reenter:
        def put(self, tokens):
            fast.generate(ids, max_new_tokens=2)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="called from inside a generate call"):
        fast.generate(ids, max_new_tokens=4, streamer=Reenter())
    # The refused call released nothing it did not hold: the model still answers, exactly.
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=4, eos_token_id=[]), ref[:, : ids.shape[1] + 4],
                        ids.shape[1])
