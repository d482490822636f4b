"""The router's parts against fake workers: no Ray, no model, no sockets. Admission bounds, the
prefill -> decode orchestration with its retries, cancellation and first-token relay, membership, and
reading a request into resolved parameters."""

from __future__ import annotations

import grpc
import pytest

from baton import metrics
from baton.api import InvalidRequestError
from baton.config import Limits
from baton.detokenizer import IncrementalDetokenizer
from baton.loader import load_tokenizer
from baton.services.info import WorkerInfo
from baton.services.router.admission import Admission, Overloaded
from baton.services.router.membership import Membership, WorkerSet
from baton.services.router.orchestrator import Orchestrator
from baton.services.router.prefix import PrefixRouter
from baton.services.router.wire import ModelInfo, RequestReader
from baton.tracing import Tracing
from baton.v1 import generation_pb2 as pb
from baton.v1 import worker_pb2 as wpb

MODEL = ModelInfo("tiny", 256, 384)
PROMPT = [5, 6, 7, 8]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """What the orchestrator uses of a grpc.ServicerContext."""

    def __init__(self) -> None:
        self.active = True
        self.callbacks: list = []
        self.trailing: tuple = ()

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        raise Aborted(code, details)

    def add_callback(self, fn) -> bool:
        self.callbacks.append(fn)
        return self.active

    def time_remaining(self):
        return None

    def set_trailing_metadata(self, md) -> None:
        self.trailing = md


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "fake failure") -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Call:
    """A streaming call: its messages, then optionally an error; records cancel()."""

    def __init__(self, messages, error: Failure | None = None) -> None:
        self.messages, self.error, self.cancelled = list(messages), error, False

    def __iter__(self):
        yield from self.messages
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class FakeFuture:
    """What a unary stub's ``.future()`` returns, for a call that has already ended."""

    def __init__(self, fn, *args) -> None:
        self.cancelled = False
        try:
            self._value, self._error = fn(*args), None
        except grpc.RpcError as e:
            self._value, self._error = None, e

    def result(self):
        if self.cancelled:
            raise grpc.FutureCancelledError()
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Unary:
    """A unary stub method: called directly, or with ``.future()`` (what the router uses)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, request, timeout=None, metadata=None):
        return self.fn(request, timeout, metadata)

    def future(self, request, timeout=None, metadata=None):
        return FakeFuture(self.fn, request, timeout, metadata)


class FakePrefill:
    def __init__(self, name: str, first_token: int = 20, error: Failure | None = None, finish: str = "") -> None:
        self.name, self.first_token, self.error, self.finish = name, first_token, error, finish
        self.requests: list[wpb.PrefillRequest] = []
        self.released: list[str] = []
        self.Prefill = Unary(self.prefill)

    def prefill(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        return wpb.PrefillResponse(first_token=self.first_token, worker=self.name, kv_bytes=100,
                                   finish_reason=self.finish)

    def Release(self, request, timeout=None):
        self.released.append(request.request_id)
        return wpb.ReleaseResponse(released=True)


class FakeDecode:
    tokenizer = None  # set by the tokenizer fixture

    def __init__(self, tokens: list[int], error: Failure | None = None, streamed_before_error: int = 0) -> None:
        self.tokens, self.error, self.streamed_before_error = tokens, error, streamed_before_error
        self.requests: list[wpb.DecodeRequest] = []
        self.calls: list[Call] = []

    def Decode(self, request, timeout=None, metadata=None):
        """Echoes the tokens it was given (the first token; a migrated request's every token so far) with the
        text of them, as a real decode worker does, then streams the rest of ``tokens`` (the output after
        the first token): all of it and "length", or ``streamed_before_error`` of it and then ``error``."""
        self.requests.append(request)
        given = list(request.generated_token_ids) or [request.first_token]
        if self.error is not None and not self.streamed_before_error:
            call = Call([], self.error)
        else:
            text = IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids)).add(given)[0]
            msgs = [pb.GenerateResponse(request_id=request.request_id, token_ids=given, text=text)]
            rest = self.tokens[len(given) - 1:]
            if self.error is not None:
                rest = rest[:self.streamed_before_error]
            msgs += [pb.GenerateResponse(request_id=request.request_id, token_ids=[t]) for t in rest]
            if self.error is None:
                msgs[-1].finish_reason = "length"
            call = Call(msgs, self.error)
        self.calls.append(call)
        return call


class Closeable:
    def close(self) -> None:
        pass


def _workers(prefills: dict, decodes: dict) -> WorkerSet:
    stubs = {**prefills, **decodes}
    ws = WorkerSet(lambda kind, address: (Closeable(), stubs[address]))
    for name in prefills:
        ws.add(name, "prefill", name)
    for name in decodes:
        ws.add(name, "decode", name)
    return ws


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    FakeDecode.tokenizer = tok
    return tok


def _orchestrator(tokenizer, ws: WorkerSet, limits: Limits | None = None) -> Orchestrator:
    admission = Admission(limits or Limits(replacement_wait_s=0.5), lambda: ws.count("decode"), ws.prefill_queues)
    return Orchestrator(ws, PrefixRouter(None, 16, MODEL.name), tokenizer, admission, Tracing(None, "router"))


def _run(orch: Orchestrator, context: FakeContext):
    return list(orch.run("r1", PROMPT, _params(), context, _span()))


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_relay_sends_the_first_token_once_and_the_workers_get_resolved_params(tokenizer):
    pre, dec = FakePrefill("p0"), FakeDecode([21, 22])
    msgs = _run(_orchestrator(tokenizer, _workers({"p0": pre}, {"d0": dec})), FakeContext())
    assert _tokens(msgs) == [20, 21, 22]
    assert msgs[-1].finish_reason == "length"
    # Every field the router resolved travels set: no worker applies a default of its own.
    sent = pre.requests[0].sampling
    assert sent.HasField("max_tokens") and sent.max_tokens == 3 and sent.HasField("temperature")
    assert dec.requests[0].sampling == sent and dec.requests[0].first_token == 20


def test_prefill_worker_failing_is_retried_on_another(tokenizer):
    bad, good = FakePrefill("p0", error=Failure(grpc.StatusCode.UNAVAILABLE)), FakePrefill("p1")
    msgs = _run(_orchestrator(tokenizer, _workers({"p0": bad, "p1": good}, {"d0": FakeDecode([21])})), FakeContext())
    assert _tokens(msgs) == [20, 21]
    assert len(bad.requests) == 1 and len(good.requests) == 1


def test_prefill_error_that_is_not_retryable_ends_the_request(tokenizer):
    bad, good = FakePrefill("p0", error=Failure(grpc.StatusCode.INVALID_ARGUMENT, "bad")), FakePrefill("p1")
    ws = _workers({"p0": bad, "p1": good}, {"d0": FakeDecode([21])})
    ws.workers["p1"].in_flight = 5  # p0 is tried first (least loaded)
    with pytest.raises(Aborted) as e:
        _run(_orchestrator(tokenizer, ws), FakeContext())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and not good.requests


def test_decode_full_is_retried_elsewhere_after_a_new_prefill(tokenizer):
    pre = FakePrefill("p0")
    full = FakeDecode([], error=Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "no blocks"))
    ok = FakeDecode([21, 22])
    ws = _workers({"p0": pre}, {"d0": full, "d1": ok})
    ws.workers["d1"].in_flight = 1  # d0 is tried first
    msgs = _run(_orchestrator(tokenizer, ws), FakeContext())
    assert _tokens(msgs) == [20, 21, 22]  # the first token once, though prefilled twice
    assert len(pre.requests) == 2 and pre.released == ["r1"]  # the first export was released
    assert all(w.in_flight == 0 for w in ws.workers.values() if w.name != "d1")


def test_every_decode_worker_full_is_resource_exhausted_with_a_retry_hint(tokenizer):
    pre = FakePrefill("p0")
    full = FakeDecode([], error=Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "no blocks"))
    context = FakeContext()
    with pytest.raises(Aborted) as e:
        _run(_orchestrator(tokenizer, _workers({"p0": pre}, {"d0": full})), context)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(context.trailing).get("grpc-retry-pushback-ms")
    assert pre.released == ["r1", "r1"]  # both prefills' exports released


def test_decode_failing_mid_stream_moves_the_request_on(tokenizer):
    """d0 streams one token after the first and dies: the router prefills the prompt and the first token (KV only,
    greedy) and d1 goes on after the two tokens the client has; it echoes them and the client gets each token
    once."""
    pre = FakePrefill("p0")
    dec = FakeDecode([21, 22, 23], error=Failure(grpc.StatusCode.UNAVAILABLE, "worker died"), streamed_before_error=1)
    other = FakeDecode([21, 22, 23])
    ws = _workers({"p0": pre}, {"d0": dec, "d1": other})
    ws.workers["d1"].in_flight = 1  # d0 is tried first
    before = metrics.sample(metrics.MIGRATIONS, cause="decode_unavailable")
    msgs = list(_orchestrator(tokenizer, ws).run("r1", PROMPT, _params(4), FakeContext(), _span()))
    assert _tokens(msgs) == [20, 21, 22, 23] and msgs[-1].finish_reason == "length"
    assert list(pre.requests[1].prompt_token_ids) == PROMPT + [20]
    assert pre.requests[1].sampling.temperature == 0 and pre.requests[1].sampling.ignore_eos
    resumed = other.requests[0]
    assert list(resumed.generated_token_ids) == [20, 21] and list(resumed.prompt_token_ids) == PROMPT
    assert resumed.sampling == pre.requests[0].sampling  # the request's own sampling, not the KV-only one
    assert metrics.sample(metrics.MIGRATIONS, cause="decode_unavailable") == before + 1
    assert all(w.in_flight == 0 for w in ws.workers.values() if w.name != "d1")


def test_text_the_client_has_is_not_sent_again(tokenizer):
    """The resumed worker's echo carries the text of every token so far; only what is new goes out."""
    from baton.services.router.orchestrator import Sent, after_sent

    ids = tokenizer.encode("Hello world, again")
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    have = detok.add(ids[:2])[0]
    echo = pb.GenerateResponse(token_ids=ids[:3], text=IncrementalDetokenizer(tokenizer, PROMPT).add(ids[:3])[0])
    out = after_sent(echo, Sent(ids[:2], have), "r1")
    assert list(out.token_ids) == [ids[2]] and have + out.text == echo.text
    assert after_sent(pb.GenerateResponse(token_ids=ids[:2], text=have), Sent(ids[:2], have), "r1") is None


def test_moves_are_bounded(tokenizer):
    dying = [FakeDecode([21, 22, 23], error=Failure(grpc.StatusCode.UNAVAILABLE, "died"), streamed_before_error=1)
             for _ in range(3)]
    ws = _workers({"p0": FakePrefill("p0")}, {f"d{i}": d for i, d in enumerate(dying)})
    got = []
    with pytest.raises(Aborted) as e:
        for m in _orchestrator(tokenizer, ws, Limits(max_migrations=1)).run("r1", PROMPT, _params(6), FakeContext(),
                                                                            _span()):
            got.append(m)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "moved 1 times" in e.value.details
    assert _tokens(got) == [20, 21, 22]  # each worker's token, once
    assert sum(len(d.requests) for d in dying) == 2


def test_no_worker_left_waits_for_a_replacement(tokenizer):
    """The only decode worker dies mid-stream; its replacement registers while the request waits."""
    import threading

    dec = FakeDecode([21, 22], error=Failure(grpc.StatusCode.UNAVAILABLE, "died"), streamed_before_error=1)
    spare = FakeDecode([21, 22])
    stubs = {"d0": dec, "p0": FakePrefill("p0"), "d1": spare}
    ws = WorkerSet(lambda kind, address: (Closeable(), stubs[address]))
    ws.add("p0", "prefill", "p0")
    ws.add("d0", "decode", "d0")
    timer = threading.Timer(0.5, lambda: ws.add("d1", "decode", "d1"))
    timer.start()
    msgs = list(_orchestrator(tokenizer, ws, Limits(replacement_wait_s=30)).run("r1", PROMPT, _params(3),
                                                                                FakeContext(), _span()))
    assert _tokens(msgs) == [20, 21, 22] and list(spare.requests[0].generated_token_ids) == [20, 21]
    # None comes: UNAVAILABLE once the wait is over.
    ws.remove("d1")
    stubs["d2"] = FakeDecode([21, 22], error=Failure(grpc.StatusCode.UNAVAILABLE, "died"), streamed_before_error=1)
    ws.add("d2", "decode", "d2")
    with pytest.raises(Aborted) as e:
        list(_orchestrator(tokenizer, ws).run("r2", PROMPT, _params(3), FakeContext(), _span()))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no decode worker" in e.value.details


def test_the_only_prefill_worker_failing_waits_for_its_replacement(tokenizer):
    import threading

    stubs = {"p0": FakePrefill("p0", error=Failure(grpc.StatusCode.UNAVAILABLE, "died")), "p1": FakePrefill("p1"),
             "d0": FakeDecode([21])}
    ws = WorkerSet(lambda kind, address: (Closeable(), stubs[address]))
    ws.add("p0", "prefill", "p0")
    ws.add("d0", "decode", "d0")
    timer = threading.Timer(0.5, lambda: ws.add("p1", "prefill", "p1"))
    timer.start()
    before = metrics.sample(metrics.MIGRATIONS, cause="prefill_unavailable")
    msgs = list(_orchestrator(tokenizer, ws, Limits(replacement_wait_s=30)).run("r1", PROMPT, _params(2),
                                                                                FakeContext(), _span()))
    assert _tokens(msgs) == [20, 21] and len(stubs["p1"].requests) == 1
    assert metrics.sample(metrics.MIGRATIONS, cause="prefill_unavailable") == before + 1


class SilentCall(Call):
    """A stream that sends the echo and then nothing (its worker's engine is stuck) until cancelled."""

    def __init__(self, messages) -> None:
        import threading

        super().__init__(messages)
        self.event = threading.Event()

    def __iter__(self):
        yield from self.messages
        self.event.wait(60)
        raise Failure(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def cancel(self) -> None:
        self.cancelled = True
        self.event.set()


class StuckDecode(FakeDecode):
    def Decode(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        text = IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids)).add([request.first_token])[0]
        call = SilentCall([pb.GenerateResponse(token_ids=[request.first_token], text=text),
                           pb.GenerateResponse(token_ids=[self.tokens[0]])])
        self.calls.append(call)
        return call


def test_a_stream_that_goes_silent_moves(tokenizer):
    """The worker lives (its health checks pass) but its stream stops: after --stall-seconds of silence the router
    cancels it and the request goes on elsewhere; the cancel is counted as the worker not answering."""
    import threading

    stuck, other = StuckDecode([21, 22, 23]), FakeDecode([21, 22, 23])
    ws = _workers({"p0": FakePrefill("p0")}, {"d0": stuck, "d1": other})
    ws.workers["d1"].in_flight = 1  # d0 first
    done = threading.Event()

    def watchdog():  # what the router's membership thread does every second
        while not done.wait(0.1):
            ws.cancel_silent(0.5)

    threading.Thread(target=watchdog, daemon=True).start()
    before = metrics.sample(metrics.MIGRATIONS, cause="decode_unresponsive")
    try:
        msgs = list(_orchestrator(tokenizer, ws).run("r1", PROMPT, _params(4), FakeContext(), _span()))
    finally:
        done.set()
    assert _tokens(msgs) == [20, 21, 22, 23] and stuck.calls[0].cancelled
    assert list(other.requests[0].generated_token_ids) == [20, 21]
    assert metrics.sample(metrics.MIGRATIONS, cause="decode_unresponsive") == before + 1
    assert not ws.stalled and not any(w.calls for w in ws.workers.values())


def test_a_client_that_reads_slowly_is_not_a_silent_worker(tokenizer):
    """While the router waits on its own client (the stream's next message not asked for yet), the worker's
    silence does not count."""
    import threading
    import time

    dec = FakeDecode([21, 22, 23])
    ws = _workers({"p0": FakePrefill("p0")}, {"d0": dec})
    done = threading.Event()

    def watchdog():
        while not done.wait(0.05):
            ws.cancel_silent(0.2)

    threading.Thread(target=watchdog, daemon=True).start()
    got = []
    before = metrics.sample(metrics.MIGRATIONS, cause="decode_unresponsive")
    try:
        for msg in _orchestrator(tokenizer, ws).run("r1", PROMPT, _params(4), FakeContext(), _span()):
            got.append(msg)
            time.sleep(0.5)  # the client reads slowly: 2.5 times the silence allowed, after every message
    finally:
        done.set()
    assert _tokens(got) == [20, 21, 22, 23] and len(dec.requests) == 1  # one stream, never given up
    assert metrics.sample(metrics.MIGRATIONS, cause="decode_unresponsive") == before


def test_a_prefill_on_a_worker_that_stops_answering_moves(tokenizer):
    """A prefill worker hangs mid-prefill; once membership drops it, its prefill is cancelled and goes to another."""
    import threading

    class Hanging:
        def __init__(self) -> None:
            self.event, self.cancelled = threading.Event(), False

        def result(self):
            self.event.wait(60)
            raise grpc.FutureCancelledError()

        def cancel(self) -> bool:
            self.cancelled = True
            self.event.set()
            return True

    hung = FakePrefill("p0")
    hung.Prefill.future = lambda request, timeout=None, metadata=None: hung.calls.append(Hanging()) or hung.calls[-1]
    hung.calls = []
    good = FakePrefill("p1")
    ws = _workers({"p0": hung, "p1": good}, {"d0": FakeDecode([21])})
    ws.workers["p1"].in_flight = 3  # p0 first
    before = metrics.sample(metrics.MIGRATIONS, cause="prefill_unavailable")
    timer = threading.Timer(0.3, lambda: ws.drop("p0"))
    timer.start()
    msgs = _run(_orchestrator(tokenizer, ws), FakeContext())
    assert _tokens(msgs) == [20, 21] and hung.calls[0].cancelled and len(good.requests) == 1
    assert good.requests[0].request_id == "r1-m1"  # a new attempt id for the moved prefill
    assert metrics.sample(metrics.MIGRATIONS, cause="prefill_unavailable") == before + 1


def test_a_worker_that_stops_answering_has_its_streams_moved(tokenizer):
    """Membership drops a worker whose health checks go unanswered: its calls in flight are cancelled at once."""
    ws = _workers({}, {"d0": FakeDecode([1])})
    w = ws.workers["d0"]
    call = Call([])
    ws.watch(w, call.cancel)
    ws.drop("d0")
    assert call.cancelled and w.dropped and "d0" not in ws.workers


def test_client_leaving_during_prefill_releases_the_kv_and_skips_decode(tokenizer):
    context = FakeContext()

    class LeavesDuringPrefill(FakePrefill):
        def prefill(self, request, timeout=None, metadata=None):
            context.active = False
            return super().prefill(request, timeout, metadata)

    pre, dec = LeavesDuringPrefill("p0"), FakeDecode([21])
    assert _run(_orchestrator(tokenizer, _workers({"p0": pre}, {"d0": dec})), context) == []
    assert pre.released == ["r1"] and not dec.requests


def test_client_leaving_after_the_first_token_releases_the_kv(tokenizer):
    pre, dec = FakePrefill("p0"), FakeDecode([21])
    stream = _orchestrator(tokenizer, _workers({"p0": pre}, {"d0": dec})).run("r1", PROMPT, _params(),
                                                                              FakeContext(), _span())
    assert _tokens([next(stream)]) == [20]
    stream.close()  # what gRPC does when the client cancels between messages
    assert pre.released == ["r1"] and not dec.requests


def test_client_cancel_mid_decode_cancels_the_downstream_call(tokenizer):
    pre, dec = FakePrefill("p0"), FakeDecode([21, 22, 23])
    ws = _workers({"p0": pre}, {"d0": dec})
    context = FakeContext()
    stream = _orchestrator(tokenizer, ws).run("r1", PROMPT, _params(5), context, _span())
    next(stream), next(stream)
    for cb in context.callbacks:  # gRPC runs these when the client cancels
        cb()
    stream.close()
    assert dec.calls[0].cancelled and ws.workers["d0"].in_flight == 0


def test_first_token_that_ends_the_request_needs_no_decode_worker(tokenizer):
    pre, dec = FakePrefill("p0", finish="stop"), FakeDecode([21])
    msgs = _run(_orchestrator(tokenizer, _workers({"p0": pre}, {"d0": dec})), FakeContext())
    assert _tokens(msgs) == [20] and msgs[0].finish_reason == "stop" and msgs[0].usage.completion_tokens == 1
    assert not dec.requests


def test_no_prefill_worker_is_unavailable(tokenizer):
    """A router that never had a prefill worker does not wait for one (nothing died that could come back)."""
    with pytest.raises(Aborted) as e:
        _run(_orchestrator(tokenizer, _workers({}, {"d0": FakeDecode([1])}), Limits(replacement_wait_s=600)),
             FakeContext())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def _params(max_tokens: int = 3):
    from baton.api import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


def _span():
    return Tracing(None, "router").tracer.start_span("test")


# -- admission ---------------------------------------------------------------------------------------------


def test_admission_bounds_in_flight_and_per_client():
    adm = Admission(Limits(max_in_flight=3, max_streams_per_client=2), lambda: 1, lambda: [0])
    adm.admit("a")
    adm.admit("a")
    with pytest.raises(Overloaded, match="--max-streams-per-client"):
        adm.admit("a")
    adm.admit("b")
    with pytest.raises(Overloaded, match="3 requests in flight"):
        adm.admit("c")
    assert adm.in_flight == 3
    adm.leave("a")
    adm.admit("c")  # a slot came back
    for client in ("a", "b", "c"):
        adm.leave(client)
    assert adm.in_flight == 0 and not adm._per_client


def test_admission_per_decode_worker_and_prefill_queue():
    decoders = [2]
    adm = Admission(Limits(max_streams_per_decode_worker=1, max_queue_s=1.0), lambda: decoders[0], lambda: [500])
    adm.admit("a")
    adm.admit("b")
    with pytest.raises(Overloaded, match="decode workers hold their limit"):
        adm.admit("c")
    decoders[0] = 4
    adm.measure_prefill(100, 1.0)  # 100 tokens/s: 500 queued tokens are 5 s, above 1 s
    with pytest.raises(Overloaded, match="prefill queue is about 5.0 s"):
        adm.admit("c")
    adm.measure_prefill(10, 0.001)  # too small a prefill to say anything about the rate
    assert adm.prefill_wait() == pytest.approx(5.0)


# -- membership ------------------------------------------------------------------------------------------


def _info(name: str, kind: str, address: str) -> WorkerInfo:
    return WorkerInfo(name=name, kind=kind, address=address, model="m", max_model_len=64, vocab_size=10,
                      block_size=16)


def test_membership_follows_discovery_and_drops_workers_that_never_answer():
    registered = [_info("p0", "prefill", "a:1"), _info("d0", "decode", "a:2")]
    answers = {"a:1": True, "a:2": True}
    forgotten: list[str] = []

    def check(w):
        if answers[w.address] is None:
            raise Failure(grpc.StatusCode.UNAVAILABLE)
        return answers[w.address]

    ws = WorkerSet(lambda kind, address: (Closeable(), object()))
    held_when_forgotten: list[bool] = []

    def forget(name: str) -> None:  # unregistered while the router still holds it: never dropped but listed
        held_when_forgotten.append(name in ws.workers)
        forgotten.append(name)

    m = Membership(ws, lambda: list(registered), forget, check, drop_after=2)
    m.refresh()
    assert set(ws.workers) == {"p0", "d0"} and m.serving()
    answers["a:2"] = False  # draining: answers NOT_SERVING, stays known but gets no requests
    m.refresh()
    assert not m.serving() and "d0" in ws.workers and ws.candidates("decode", set()) == []
    answers["a:2"] = None  # no answer at all, twice: dropped and unregistered
    m.refresh()
    m.refresh()
    assert "d0" not in ws.workers and forgotten == ["d0"] and held_when_forgotten == [True]
    registered[:] = [registered[0]]
    answers["a:2"] = True
    m.refresh()
    assert set(ws.workers) == {"p0"}


# -- reading a request ----------------------------------------------------------------------------------


def test_reader_resolves_defaults_and_names_the_field(tokenizer):
    reader = RequestReader(tokenizer, MODEL, Limits(max_output_tokens=64, default_max_tokens=7))
    req = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(temperature=0))
    params = reader.sampling(req)
    assert params.max_tokens == 7 and params.temperature == 0
    with pytest.raises(InvalidRequestError) as e:
        reader.sampling(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=65)))
    assert e.value.field == "sampling.max_tokens" and "--max-output-tokens" in e.value.detail()
    with pytest.raises(InvalidRequestError) as e:
        reader.sampling(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=0)))
    assert e.value.detail().startswith("sampling.top_p")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        reader.prompt_ids(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, MODEL.vocab_size])))
    assert reader.prompt_ids(pb.GenerateRequest(prompt="hello")) == tokenizer.encode("hello")
