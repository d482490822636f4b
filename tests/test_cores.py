"""Cores that follow the load (services/cores.py): the board, the publisher and the borrower on real
threads and real CPU affinity; then the session's pinned stack, where the prefill worker runs a long
prompt on the idle decode worker's core and gives it back."""

from __future__ import annotations

import os
import threading

import pytest
import ray
import torch

from baton.services.cores import BUSY, CoreBoard, CoreBorrower, CorePublisher, CoreSharing
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


class _Engine:
    """What CoreSharing reads of an engine: its scheduler's queues and whether it has a request."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.scheduler = SimpleNamespace(waiting=[], running=[])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)


def test_a_decode_worker_borrows_the_idle_prefill_core_and_gives_it_back(tmp_path) -> None:
    """Both kinds share (CoreSharing): the prefill worker marks its core idle while it has no prompt token to
    compute and the decode worker, with sequences to decode, runs on it too; once the prefill worker has a prompt
    its core is busy, and the decode worker is back on its own core at its next pass."""
    from types import SimpleNamespace

    path = CoreBoard.create(str(tmp_path / "cores"))
    pre_core, dec_core = [CORES[-1]], [CORES[0]]
    prefill, decode = _Engine(), _Engine()
    pre = CoreSharing("prefill", CoreBoard(path), pre_core, dec_core, threads=1, min_tokens=100)
    results: dict = {}

    def decode_thread() -> None:
        os.sched_setaffinity(0, dec_core)
        torch.set_num_threads(1)
        dec = CoreSharing("decode", CoreBoard(path), dec_core, pre_core, threads=1, min_tokens=1)
        dec.before_step(decode)  # nothing to decode: borrows nothing, lends its core
        results["idle"] = (dec.state(), sorted(os.sched_getaffinity(0)))
        decode.scheduler.running.append(object())
        pre.before_step(prefill)  # the prefill worker has nothing: its core is idle
        dec.before_step(decode)
        results["decoding"] = (dec.state(), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        prefill.scheduler.waiting.append(SimpleNamespace(num_prompt_tokens=50, num_computed_tokens=0))
        pre.before_step(prefill)  # a short prompt: the prefill worker takes its core back, borrows nothing
        results["prefill state"] = pre.state()
        dec.before_step(decode)
        results["given back"] = (dec.state(), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        dec.close()

    t = threading.Thread(target=decode_thread)
    t.start()
    t.join()
    lent = pre_core != dec_core
    assert results["idle"][0]["borrowed"] == [] and results["idle"][0]["idle"] and results["idle"][1] == dec_core
    state, affinity, threads = results["decoding"]
    assert not state["idle"] and state["borrowed"] == (pre_core if lent else [])
    assert affinity == sorted(set(dec_core + pre_core)) and threads == 1 + lent
    assert results["prefill state"]["borrowed"] == [] and not results["prefill state"]["idle"]
    assert results["given back"] == ({**results["given back"][0], "borrowed": []}, dec_core, 1)
    assert results["given back"][0]["passes_borrowed"] == int(lent)
    assert CoreBoard(path).idle(dec_core) == []  # a worker that stops lends nothing
    pre.close()


def _shared(stack) -> tuple[dict, dict]:
    (pre,), (dec,) = ray.get([h.core_sharing.remote() for h in stack.prefill]), \
        ray.get([h.core_sharing.remote() for h in stack.decode])
    return pre, dec


def test_a_long_prompt_borrows_the_idle_decode_core_and_gives_it_back(stack) -> None:
    """On the pinned stack (one prefill and one decode worker on their own cores): with the decode
    worker idle, a prompt longer than a pass runs its prefill passes on both cores, and the prefill
    worker is back on its own core when it is done; while the decode worker streams, it runs on the idle
    prefill core too, and a long prompt borrows nothing. The answer is the same either way."""
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
        for _ in range(50):  # the prefill worker has nothing to compute: the decoding runs on its core too
            if _shared(stack)[1]["borrowed"]:
                break
            next(stream)
        assert _shared(stack)[1]["borrowed"] == pre["cpus"]
        before = _shared(stack)[0]["passes_borrowed"]
        (busy_answer,) = list(c.stream(long_req, timeout=120))
        during = _shared(stack)
        rest = list(stream)
    assert rest and rest[-1].finish_reason == "length"  # the decode stream was still running
    assert during[0]["passes_borrowed"] == before and not during[1]["idle"]
    assert list(busy_answer.token_ids) == list(idle_answer.token_ids)
    assert abs(busy_answer.logprobs[0] - idle_answer.logprobs[0]) < 1e-3
    assert _shared(stack)[1]["idle"]
