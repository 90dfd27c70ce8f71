"""`CommEvent.wait` makes the stream that will read the results wait: the current stream of the device the
operation ran on (the event's), whichever device is current. On the CPU with a stand-in event and stream
table; on a GPU with real events (two GPUs: the current device another than the event's)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import pytest
import torch

from moonep_moe.comm.event import CommEvent


@dataclass
class FakeStream:
    device: torch.device
    waited: list = field(default_factory=list)

    def wait_event(self, event) -> None:
        self.waited.append(event)


@dataclass
class FakeEvent:
    """A recorded CUDA event as `CommEvent` sees it: `device` is where it was recorded."""

    device: torch.device


def test_wait_is_queued_on_the_events_device_not_the_current_one(monkeypatch):
    streams = {torch.device("cuda", index): FakeStream(torch.device("cuda", index)) for index in (0, 1)}
    current_device = torch.device("cuda", 0)

    def current_stream(device=None):
        return streams[torch.device(device) if device is not None else current_device]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    event = FakeEvent(torch.device("cuda", 1))
    CommEvent(event).wait()
    assert streams[torch.device("cuda", 1)].waited == [event]
    assert streams[torch.device("cuda", 0)].waited == []


def test_wait_without_an_event_does_nothing():
    CommEvent(None).wait()
    assert CommEvent(None).query()


def test_inputs_are_held_until_the_wait_then_released(monkeypatch):
    """The operation's inputs live as long as the event is not waited for (the comm stream may still read
    them), and are released by `wait()`, after the caller's stream was ordered behind the operation."""
    stream = FakeStream(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    held = torch.zeros(4)
    alive = weakref.ref(held)
    comm = CommEvent(FakeEvent(torch.device("cuda", 0)), (held,))
    del held
    gc.collect()
    assert alive() is not None
    comm.wait()
    gc.collect()
    assert alive() is None and len(stream.waited) == 1


def test_an_event_dropped_without_its_wait_orders_the_callers_stream_first(monkeypatch):
    stream = FakeStream(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    event = FakeEvent(torch.device("cuda", 0))
    comm = CommEvent(event, (torch.zeros(4),))
    del comm
    gc.collect()
    assert stream.waited == [event]


@pytest.mark.gpu
def test_wait_uses_the_stream_of_the_device_the_event_was_recorded_on(monkeypatch):
    """One GPU is enough to check the path: the event of a real operation names its device, and `wait` asks
    for that device's current stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        event = torch.cuda.Event()
        event.record(side)
    asked = []
    current_stream = torch.cuda.current_stream
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: asked.append(device) or current_stream(device))
    CommEvent(event).wait()
    assert [torch.device(d) for d in asked] == [device]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_wait_orders_the_events_device_while_another_is_current():
    """An operation on cuda:1 (late: behind a long sleep) while cuda:0 is current: after `wait()`, what
    cuda:1's current stream reads is the operation's result."""
    result = torch.zeros(1 << 20, device="cuda:1")
    comm = torch.cuda.Stream("cuda:1")
    comm.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.device(1), torch.cuda.stream(comm):
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        result.fill_(1.0)
        event = torch.cuda.Event()
        event.record(comm)
    with torch.cuda.device(0):
        CommEvent(event).wait()
        seen = result.clone()  # runs on cuda:1's current stream
    assert bool((seen == 1.0).all())
