"""`run_eagerly`: how `MoonEPMoELayer.forward` keeps its routed step out of `torch.compile`'s graphs.

Imported by the layer's forward only while `torch.compile` traces it (`torch.compiler.is_compiling()`):
`torch.compiler.disable` imports torch._dynamo, which takes about as long as importing torch itself, and a
process that never compiles should not pay for it in every layer it builds. The import inside a traced
forward runs when dynamo meets it (dynamo performs imports, it does not trace them), so this module, and the
disabled function it makes, exist before the graph breaks at the call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moonep_moe.layers.function import COMPILE_BREAK_REASON


def _run(step: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    return step(*args)


run_eagerly = torch.compiler.disable(_run, reason=COMPILE_BREAK_REASON)
"""`run_eagerly(step, *args) = step(*args)`, run eagerly between compiled graphs: the graph breaks around it
(`COMPILE_BREAK_REASON`, also what `fullgraph=True` raises with)."""
