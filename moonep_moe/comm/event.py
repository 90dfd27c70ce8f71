"""`CommEvent`: the one object that owns the wait for a comm operation queued on a comm stream.

Every comm call returns its event last, as MoonEP's Buffer does: `Buffer.dispatch` -> `(..., plan, event)`
with `async_finish=True` (without it `(..., plan)`: no event item), `Buffer.combine` -> `(hidden_sh,
route_weights_sk, event)`, `Buffer.prefetch_weight` and `Buffer.reduce_grad` -> `event`. The event is a
`CommEvent` with `async_finish`, None without (the operation ran on the caller's stream, nothing to wait
for). `MoECommunicator`'s requests wait through it too.
"""

from __future__ import annotations

import torch


class CommEvent:
    """The end of an operation queued with `async_finish=True` on a comm stream. Nothing the operation
    returned or wrote may be used on another stream before `wait()`. Off CUDA the operation had finished
    before its call returned (`event` is None).

    It holds the operation's inputs (`held`) until `wait()`, so their memory is not reused while the comm
    stream reads them; after the wait the caller's stream is ordered behind the operation, and the inputs
    are freed there like any tensor, at once. (Marking them with `record_stream` instead would keep their
    blocks allocated until the allocator happens to see the operation finished: a peak memory that depends
    on the GPU's timing.) An event dropped without `wait()` makes the caller's stream wait for it first."""

    __slots__ = ("event", "_held")

    def __init__(self, event: torch.cuda.Event | None, held: tuple[torch.Tensor, ...] = ()) -> None:
        self.event = event
        self._held = held

    def wait(self) -> None:
        """Make the current stream of the operation's device (the event's: where its results live) wait for
        the operation, whichever device is current (returns at once on the host), and release its inputs."""
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)
        self._held = ()

    def query(self) -> bool:
        """Whether the operation has finished on the device (True off CUDA). Does not block."""
        return self.event is None or self.event.query()

    def __del__(self) -> None:
        if self._held and self.event is not None:  # freed inputs must not be reused before the operation ends
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - interpreter shutdown: no stream left to order
                pass
