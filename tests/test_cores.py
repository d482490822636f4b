"""Cores that follow the load (services/cores.py): the board, the publisher and the borrower on real
threads and real CPU affinity; then the session's pinned stack, where the prefill worker runs a long
prompt on the idle decode worker's core and gives it back."""

from __future__ import annotations

import os
import threading

import pytest
import ray
import torch

from baton.services.cores import BUSY, CoreBoard, CoreBorrower, CorePublisher
from baton.v1 import generation_pb2 as pb

CORES = sorted(os.sched_getaffinity(0))


def test_board_publisher_and_borrower_follow_the_decode_workers_state(tmp_path) -> None:
    """A core is lent only while its decode worker has nothing to do and only for a pass with at least
    min_tokens to compute; the borrower's thread runs on its own cores plus the lent ones with one more
    kernel thread each, and is back on its own cores, with its own thread count, once it gives them back."""
    path = CoreBoard.create(str(tmp_path / "cores"))
    assert (tmp_path / "cores").read_bytes() == bytes([BUSY]) * (os.cpu_count() or 1)  # nothing lent by default
    own, other = [CORES[0]], [CORES[-1]]
    pub = CorePublisher(CoreBoard(path), other)
    results: dict = {}

    def prefill_thread() -> None:  # the borrower lives on the engine thread: affinity is per thread
        os.sched_setaffinity(0, own)
        torch.set_num_threads(1)
        b = CoreBorrower(CoreBoard(path), own, other + own, threads=1, min_tokens=100)
        assert b.others == other  # its own cores are never "borrowed"
        results["busy"] = (b.before_pass(500), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        pub.update(busy=False)
        results["short"] = (b.before_pass(99), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        results["long"] = (b.before_pass(100), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        pub.update(busy=True)
        results["taken"] = (b.before_pass(1000), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        results["passes"] = b.passes_borrowed

    pub.update(busy=True)
    t = threading.Thread(target=prefill_thread)
    t.start()
    t.join()
    lend = sorted(set(own + other))
    assert results["busy"] == ([], own, 1)
    assert results["short"] == ([], own, 1)
    assert results["long"] == (other if other != own else [], lend, 1 + (other != own))
    assert results["taken"] == ([], own, 1)
    assert results["passes"] == (1 if other != own else 0)
    pub.update(busy=False)
    assert CoreBoard(path).idle(other) == other
    pub.close()  # a decode worker that stops lends nothing
    assert CoreBoard(path).idle(other) == []
    assert sorted(os.sched_getaffinity(0)) == CORES  # the test's own thread was never touched


def _shared(stack) -> tuple[dict, dict]:
    (pre,), (dec,) = ray.get([h.core_sharing.remote() for h in stack.prefill]), \
        ray.get([h.core_sharing.remote() for h in stack.decode])
    return pre, dec


def test_a_long_prompt_borrows_the_idle_decode_core_and_gives_it_back(stack) -> None:
    """On the pinned stack (one prefill and one decode worker on their own cores): with the decode
    worker idle, a prompt longer than a pass runs its prefill passes on both cores, and the prefill
    worker is back on its own core when it is done; while the decode worker streams, a long prompt
    borrows nothing. The answer is the same either way."""
    if not stack.pinned or len(stack.prefill) != 1 or len(stack.decode) != 1 or stack._core_board is None:
        pytest.skip("needs the session stack pinned with one worker of each kind (2 cores or more)")
    from baton.api.client import Client

    pre, dec = _shared(stack)
    assert set(pre["share"]) == set(dec["cpus"]) and dec["idle"]
    words = " ".join(f"item{i} costs {i * 7 % 13} coins" for i in range(160))  # about 900 tokens
    long_req = pb.GenerateRequest(prompt=words, sampling=pb.SamplingParams(max_tokens=1, temperature=0,
                                                                          logprobs=True))
    with Client(stack.address) as c:
        before = pre["passes_borrowed"]
        (idle_answer,) = list(c.stream(long_req, timeout=120))
        pre, dec = _shared(stack)
        assert pre["passes_borrowed"] > before and pre["borrowed"] == [] and dec["idle"]
        # Now keep the decode worker busy, and send the same long prompt.
        busy_req = pb.GenerateRequest(prompt="Count to one thousand:", sampling=pb.SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True))
        stream = c.stream(busy_req, timeout=120)
        next(stream), next(stream)  # decoding
        assert not _shared(stack)[1]["idle"]
        before = _shared(stack)[0]["passes_borrowed"]
        (busy_answer,) = list(c.stream(long_req, timeout=120))
        during = _shared(stack)
        rest = list(stream)
    assert rest and rest[-1].finish_reason == "length"  # the decode stream was still running
    assert during[0]["passes_borrowed"] == before and not during[1]["idle"]
    assert list(busy_answer.token_ids) == list(idle_answer.token_ids)
    assert abs(busy_answer.logprobs[0] - idle_answer.logprobs[0]) < 1e-3
    assert _shared(stack)[1]["idle"]
