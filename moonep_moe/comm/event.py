"""`CommEvent`: the one object that owns the wait for a comm operation queued on a comm stream.

Every comm call returns its event last, as MoonEP's Buffer does: `Buffer.dispatch` -> `(..., plan, event)`
with `async_finish=True` (without it `(..., plan)`: no event item), `Buffer.combine` -> `(hidden_sh,
route_weights_sk, event)`, `Buffer.prefetch_weight` and `Buffer.reduce_grad` -> `event`. The event is a
`CommEvent` with `async_finish`, None without (the operation ran on the caller's stream, nothing to wait
for). `MoECommunicator`'s requests wait through it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommEvent:
    """The end of an operation queued with `async_finish=True` on a comm stream. Nothing the operation
    returned or wrote may be used on another stream before `wait()`. Off CUDA the operation had finished
    before its call returned (`event` is None)."""

    event: torch.cuda.Event | None

    def wait(self) -> None:
        """Make the current stream of the operation's device (the event's: where its results live) wait for
        the operation, whichever device is current (returns at once on the host)."""
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)

    def query(self) -> bool:
        """Whether the operation has finished on the device (True off CUDA). Does not block."""
        return self.event is None or self.event.query()
