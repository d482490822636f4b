"""Cores that follow the load (services/cores.py): the board, the publisher and the borrowers on real
threads and real CPU affinity; the engine's same bits on one and two threads; then the session's pinned
stack, where the prefill worker runs a long prompt on the idle decode worker's core and the decode worker
streams on the idle prefill worker's core, each giving the core back."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import ray
import torch

from baton.services.cores import BUSY, IDLE, CoreBoard, CoreBorrower, CorePublisher, StepTimes
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
    """What a borrower reads of an engine: whether it has a request, and its sequences' prompt progress."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(waiting=[], running=[])

    def work(self, prompt_tokens: int = 0) -> None:
        self.scheduler.running = [SimpleNamespace(num_prompt_tokens=prompt_tokens + 1, num_computed_tokens=1)]

    def finish(self) -> None:
        self.scheduler.running = []

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running)

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.running)


@pytest.mark.skipif(len(CORES) < 2, reason="lending a core needs two")
def test_prefill_and_decode_workers_lend_each_other_their_idle_cores(tmp_path) -> None:
    """Each worker marks its cores idle while its engine has nothing to do. The decode worker borrows the
    idle prefill core for every step while it has a request, and gives it back at the next step once the
    prefill worker has a prompt; the prefill worker borrows the decode core only for a long prompt while
    the decode worker is idle. Neither holds the other's core while its own is lent."""
    path = CoreBoard.create(str(tmp_path / "cores"))
    pc, dc = [CORES[0]], [CORES[-1]]
    board = CoreBoard(path)

    def worker(own, others, **kw):  # each on a thread of its own: affinity is per thread
        pool = ThreadPoolExecutor(1)
        b = pool.submit(lambda: (os.sched_setaffinity(0, own), torch.set_num_threads(1),
                                 CoreBorrower(CoreBoard(path), own, others, threads=1,
                                              publisher=CorePublisher(CoreBoard(path), own), **kw))[-1]).result()
        engine = _Engine()

        def step():
            return pool.submit(lambda: (b.before_step(engine), b.borrowed, sorted(os.sched_getaffinity(0)),
                                        torch.get_num_threads())[1:]).result()
        return pool, b, engine, step

    ppool, pre, peng, pstep = worker(pc, dc, min_tokens=100)
    dpool, dec, deng, dstep = worker(dc, pc, per_step=True)
    try:
        assert pstep() == ([], pc, 1) and dstep() == ([], dc, 1)  # both idle: nothing borrowed, both lent
        assert board.idle(pc + dc) == pc + dc
        deng.work()  # a request to decode: every step on both cores, two kernel threads
        assert dstep() == (pc, sorted(pc + dc), 2) and board.idle(dc) == []
        assert dstep() == (pc, sorted(pc + dc), 2)
        peng.work(prompt_tokens=500)  # a long prompt: the prefill worker's core is busy, and it borrows nothing
        assert pstep() == ([], pc, 1) and board.idle(pc) == []
        assert dstep() == ([], dc, 1)  # the decode worker gives it back at its next step
        peng.finish()
        assert pstep() == ([], pc, 1) and board.idle(pc) == pc
        assert dstep() == (pc, sorted(pc + dc), 2)
        deng.finish()  # done decoding: gives the core back, then lends its own
        assert dstep() == ([], dc, 1) and board.idle(dc) == dc
        peng.work(prompt_tokens=500)
        assert pstep() == (dc, sorted(pc + dc), 2)
        layer = lambda: ppool.submit(lambda: (pre.between_layers(), pre.borrowed,  # noqa: E731
                                              sorted(os.sched_getaffinity(0)), torch.get_num_threads())[1:]).result()
        assert layer() == (dc, sorted(pc + dc), 2)  # between two layers: the decode core is still idle
        deng.work()  # a request to decode mid-pass: the prefill worker's core is busy, so it borrows nothing
        assert dstep() == ([], dc, 1) and board.idle(dc) == []
        assert layer() == ([], pc, 1)  # given back at the next layer, not at the next pass
        deng.finish()
        assert dstep() == ([], dc, 1) and board.idle(dc) == dc
        peng.work(prompt_tokens=50)  # a short prompt: not worth it
        assert pstep() == ([], pc, 1)
        assert pre.state()["passes_borrowed"] == 1 and dec.state()["passes_borrowed"] == 3
        assert dec.state()["idle"] and not pre.state()["idle"]
    finally:
        for pool, b in ((ppool, pre), (dpool, dec)):
            pool.submit(b.close).result()
            pool.shutdown()
    assert board.idle(pc + dc) == []  # a worker that stops lends nothing
    assert sorted(os.sched_getaffinity(0)) == CORES


def test_step_times_pick_the_faster_way_for_each_number_of_requests_and_recheck_the_other() -> None:
    """Each key tries both ways first, then keeps to the faster one but for one step in every ``recheck``,
    which is how it notices that the other way became faster."""
    t = StepTimes(tries=2, recheck=4)
    seconds = {True: 0.040, False: 0.030}  # borrowing is slower here
    ways = []
    for _ in range(14):
        way = t.borrow(16)
        ways.append(way)
        t.record(16, way, seconds[way])
    assert ways[:4] == [True, True, False, False]  # tried both ways
    assert ways[4:] == [False, False, False, True] * 2 + [False, False]  # the faster, rechecking the slower
    assert t.borrow(1) is True  # another number of requests is a key of its own
    seconds = {True: 0.010, False: 0.030}  # the other cores became free: the rechecks see it
    for _ in range(12):
        way = t.borrow(16)
        t.record(16, way, seconds[way])
    assert sum(t.borrow(16) for _ in range(8)) == 6  # borrows now, rechecking its own cores 1 in 4
    means = t.state()[16]
    assert means["borrowed"] < means["own"]


@pytest.mark.skipif(len(CORES) < 2, reason="lending a core needs two")
def test_a_decode_worker_borrows_only_where_its_steps_ran_faster(tmp_path) -> None:
    """The decode worker's steps, timed by the borrower's clock: while borrowed steps take longer, it runs
    most steps on its own core (the idle one is still tried now and then); once they take less, it
    borrows again."""
    path = CoreBoard.create(str(tmp_path / "cores"))
    own, other = [CORES[-1]], [CORES[0]]
    board = CoreBoard(path)
    board.publish(other, IDLE)
    now = [0.0]
    pool = ThreadPoolExecutor(1)
    b = pool.submit(lambda: (os.sched_setaffinity(0, own), torch.set_num_threads(1),
                             CoreBorrower(CoreBoard(path), own, other, threads=1, per_step=True,
                                          publisher=CorePublisher(CoreBoard(path), own), clock=lambda: now[0]))[-1]
                    ).result()
    engine = _Engine()
    engine.work()

    def steps(n: int, borrowed_s: float, own_s: float) -> list[bool]:
        def step() -> bool:
            b.before_step(engine)
            ran_borrowed = bool(b.borrowed)
            assert sorted(os.sched_getaffinity(0)) == sorted(own + b.borrowed)
            now[0] += borrowed_s if ran_borrowed else own_s
            b.after_step()
            return ran_borrowed
        return [pool.submit(step).result() for _ in range(n)]

    try:
        ways = steps(40, borrowed_s=0.040, own_s=0.030)
        assert ways[:4] == [True, True, False, False]
        assert 1 <= sum(ways[4:]) <= 4  # mostly on its own core; rechecked now and then
        means = b.state()["step_seconds"][1]
        assert means["own"] == pytest.approx(0.030) and means["borrowed"] == pytest.approx(0.040)
        ways = steps(60, borrowed_s=0.010, own_s=0.030)
        assert sum(ways[-16:]) == 15  # borrowing is faster now: every step borrows but the one recheck
    finally:
        pool.submit(b.close).result()
        pool.shutdown()


def test_the_engine_gives_the_same_bits_on_one_and_two_threads(default_model) -> None:
    """Borrowing changes a worker's kernel threads between passes and between the layers of a pass; the
    tokens and their logprobs do not change with them (prefix caching off, so each run computes every
    position itself)."""
    from baton.api.params import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, kv_cache_memory=64 << 20), loaded=default_model)
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):",
                                                     "Once upon a time, in a land far away, " * 6)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=True, ignore_eos=True)
    threads = torch.get_num_threads()
    switches = []

    def between_layers() -> None:  # as a borrowing prefill pass may: another thread count from layer to layer
        switches.append(1)
        torch.set_num_threads(1 + len(switches) % 2)

    runs = []
    try:
        for n in (1, 2, 1, "per layer"):
            engine.model.between_layers = between_layers if n == "per layer" else None
            torch.set_num_threads(1 if n == "per layer" else n)
            runs.append([(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)])
    finally:
        engine.model.between_layers = None
        torch.set_num_threads(threads)
    assert runs[0] == runs[2]  # the same run twice: no noise to hide behind
    assert runs[1] == runs[0]
    assert runs[3] == runs[0]
    assert switches and len(switches) % (engine.model.config.num_layers - 1) == 0  # once between each two layers


def _shared(stack) -> tuple[dict, dict]:
    (pre,), (dec,) = ray.get([h.core_sharing.remote() for h in stack.prefill]), \
        ray.get([h.core_sharing.remote() for h in stack.decode])
    return pre, dec


def _settled(stack, done, tries: int = 100) -> tuple[dict, dict]:
    """The workers' sharing state once ``done`` holds of it (each engine loop updates it on its own thread,
    right after its last pass)."""
    for _ in range(tries):
        state = _shared(stack)
        if done(*state):
            return state
        time.sleep(0.05)
    return state


def test_idle_cores_are_lent_both_ways_on_the_pinned_stack(stack) -> None:
    """On the pinned stack (one prefill and one decode worker on their own cores): with the decode
    worker idle, a prompt longer than a pass runs its prefill passes on both cores, and the prefill
    worker is back on its own core when it is done; while the decode worker streams, it runs its steps
    on the idle prefill core too, and a long prompt then borrows nothing. The answer is the same either
    way, and both workers are back on their own cores, lending them, when the work is done."""
    if not stack.pinned or len(stack.prefill) != 1 or len(stack.decode) != 1 or stack._core_board is None:
        pytest.skip("needs the session stack pinned with one worker of each kind (2 cores or more)")
    from baton.api.client import Client

    idle = lambda pre, dec: pre["idle"] and dec["idle"] and not pre["borrowed"] and not dec["borrowed"]  # noqa: E731
    pre, dec = _settled(stack, idle)
    assert set(pre["share"]) == set(dec["cpus"]) and set(dec["share"]) == set(pre["cpus"]) and idle(pre, dec)
    words = " ".join(f"item{i} costs {i * 7 % 13} coins" for i in range(160))  # about 900 tokens
    long_req = pb.GenerateRequest(prompt=words, sampling=pb.SamplingParams(max_tokens=1, temperature=0,
                                                                          logprobs=True))
    with Client(stack.address) as c:
        before = pre["passes_borrowed"]
        (idle_answer,) = list(c.stream(long_req, timeout=120))
        pre, dec = _settled(stack, idle)
        assert pre["passes_borrowed"] > before and idle(pre, dec)
        # Now keep the decode worker busy, and send the same long prompt.
        busy_req = pb.GenerateRequest(prompt="Count to one thousand:", sampling=pb.SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True))
        steps_before = dec["passes_borrowed"]
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
    pre, dec = _settled(stack, idle)
    assert idle(pre, dec)
    assert dec["passes_borrowed"] > steps_before  # the stream's steps ran on the prefill core too
