"""EngineLoop: the engine on its own thread, fed by handler threads that must never wait on a long step."""

from __future__ import annotations

import threading

import pytest

from baton.api import InvalidRequestError, SamplingParams
from baton.config import EngineConfig, ServeConfig, default_of
from baton.engine.engine import LLMEngine, RequestOutput
from baton.loader import load_model
from baton.services.worker import EngineLoop


@pytest.fixture()
def loop(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4),
                       loaded=load_model(str(tiny_llama_dir)))
    lp = EngineLoop(engine, admission_wait=default_of(ServeConfig, "admission_wait"))
    lp.start()
    yield lp
    lp.stop()


def _collect(q) -> list:
    outs = []
    while True:
        out = q.get(timeout=30)
        outs.append(out)
        if not isinstance(out, RequestOutput) or out.finished:
            return outs


def test_adding_does_not_wait_for_a_long_step(loop):
    """Event order, no clock: the engine thread is inside a command that only the test ends (as in a long
    forward pass), and ``add`` returns while that command is still running. An ``add`` that waited for the
    engine thread would return only after the command gave up (60 s), which the last assert catches."""
    running, release, ended = threading.Event(), threading.Event(), threading.Event()

    def long_step() -> None:
        running.set()
        release.wait(60)
        ended.set()

    loop.submit(long_step)
    assert running.wait(30), "the engine thread never ran the command"
    engine = loop.engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    q = loop.add("r1", lambda: engine.add_request([5, 6, 7], params, request_id="r1"),
                 check=lambda: engine.check_prompt([5, 6, 7]))
    assert not ended.is_set()  # add returned while the engine thread was still busy
    assert q.empty()  # and nothing ran for the request yet: its output comes after the long step
    release.set()
    outs = _collect(q)
    assert ended.is_set() and outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3


def test_bad_prompt_is_refused_on_the_callers_thread(loop):
    engine = loop.engine
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        loop.add("bad", lambda: None, check=lambda: engine.check_prompt([10**7]))


def test_duplicate_request_id_fails_on_the_queue_and_leaves_the_first_alone(loop):
    engine = loop.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    release = threading.Event()
    loop.submit(lambda: release.wait(10))
    first = loop.add("dup", lambda: engine.add_request([5, 6, 7], params, request_id="dup"))
    second = loop.add("dup", lambda: engine.add_request([8, 9], params, request_id="dup"))
    release.set()
    err = second.get(timeout=30)
    assert isinstance(err, InvalidRequestError) and "already in use" in str(err)
    outs = _collect(first)
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 20
