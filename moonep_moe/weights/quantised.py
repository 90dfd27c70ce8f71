"""FP8 expert weights as the GEMMs and the comm core take them: `Fp8Weights` (home experts and slots, e4m3
with their block scales) and `rows_as_bytes` (the byte views the exchanges move: torch has no CPU kernels
for most float8 ops, and gloo no float8 collectives)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moonep_moe.fp8.format import as_bytes
from moonep_moe.transport.world import SymmetricTensor
from moonep_moe.weights.pool import ExpertRows


@dataclass(frozen=True)
class Fp8Weights:
    """Grouped FP8 weights as stored, for a grouped GEMM (`gemm.fp8`): ``q`` parts ``[g_i, N, K]`` e4m3
    whose groups concatenate to G (e.g. home experts, then prefetch slots) and ``scales`` parts
    ``[g_i, ceil(N/128), ceil(K/128)]`` fp32, split alike; ``weight ~= q * scale`` per 128x128 block."""

    q: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]

    def joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [G, N, K], scales [G, ceil(N/128), ceil(K/128)])``, each one contiguous tensor: the part
        itself where there is one, else a copy of the parts (FP8 bytes and fp32 scales, no wider copy)."""
        def join(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if len(parts) == 1:
                return parts[0]
            return torch.cat([as_bytes(part) for part in parts]).view(parts[0].dtype)

        return join(self.q), join(self.scales)


def rows_as_bytes(rows: ExpertRows) -> ExpertRows:
    """`ExpertRows` whose home (every peer's) and slots are `as_bytes` views of `rows`' (the same memory)."""

    def view(tensor: SymmetricTensor) -> SymmetricTensor:
        return replace(tensor, peers=tuple(None if p is None else as_bytes(p) for p in tensor.peers))

    compute = None if rows.compute is None else as_bytes(rows.compute)
    return ExpertRows(view(rows.home), view(rows.slots), compute)
