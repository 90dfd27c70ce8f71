"""The engine contract of seed 002, end to end: `MoECommunicator` behind an adapter shaped like vLLM's modular
MoE kernel (`FusedMoEPrepareAndFinalize`: prepare -> the engine's experts -> finalize).

- prepare: quantise-free dispatch of the batch into expert-grouped rows plus per-group counts (and the hot
  experts' weights into this rank's slots);
- experts: run by the test on that layout (`grouped_swiglu`, no host read);
- finalize: combine written in place into the caller's `output` tensor.

Decode batches are padded to the batch-size bucket with expert -1 (the padding's rows hold garbage: they must
be ignored and combine to zero). Checked against a dense reference: on the CPU with four thread-ranks
(float64), and inside a CUDA graph on one GPU (marked gpu).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from test_serving import F64, H, K, R, S, comm_config, dense_moe, grouped_swiglu, model_weights, step_inputs

from bench.common import captured_graph
from moonep_moe.engine.communicator import DispatchHandle, MoECommunicator
from moonep_moe.engine.layout import ExpertLayout
from moonep_moe.transport.threads import run_ranks, single_world


@dataclass(frozen=True)
class ExpertGroupedRows:
    """What prepare hands the experts: `tokens_nvsh [NvS, H]` grouped by compute group, `weights_nvs [NvS]`,
    `expert_num_tokens_g [epn+B]` valid rows per group, `offsets_g [epn+B]` padded group ends and
    `expert_ids_g [epn+B]` (-1: an empty slot group)."""

    tokens_nvsh: torch.Tensor
    weights_nvs: torch.Tensor
    expert_num_tokens_g: torch.Tensor
    offsets_g: torch.Tensor
    expert_ids_g: torch.Tensor


class MoonEPPrepareAndFinalize:
    """The prepare / finalize half of a modular MoE kernel over one `MoECommunicator` and one bucket. Holds
    the in-flight step's handle between prepare and finalize (one step at a time)."""

    def __init__(self, comm: MoECommunicator, layout: ExpertLayout, bucket: int):
        self.comm, self.layout, self.bucket = comm, layout, bucket
        self._handle: DispatchHandle | None = None

    def prepare(self, a1_th: torch.Tensor, topk_weights_tk: torch.Tensor, topk_ids_tk: torch.Tensor
                ) -> ExpertGroupedRows:
        """`a1_th [bucket, H]`, `topk_weights_tk [bucket, K]`, `topk_ids_tk [bucket, K]` (-1: padding)."""
        out, self._handle = self.comm.dispatch(a1_th, topk_ids_tk, topk_weights_tk, capacity=self.bucket)
        self.comm.prefetch_weights(self._handle, self.layout)
        return ExpertGroupedRows(out.tokens_nvsh, out.weights_nvs, out.num_tokens_per_expert_g, out.offsets_g,
                                 out.expert_ids_g)

    def finalize(self, output_th: torch.Tensor, fused_expert_output_nvsh: torch.Tensor) -> None:
        """Combine the experts' weighted rows into `output_th [bucket, H]`, in place."""
        self.comm.combine(fused_expert_output_nvsh, self._handle, out=output_th)
        self._handle = None


def modular_forward(pf: MoonEPPrepareAndFinalize, hidden_th, topk_weights_tk, topk_ids_tk, output_th
                    ) -> ExpertGroupedRows:
    """prepare -> experts (the test's) -> finalize, as the modular kernel sequences them."""
    rows = pf.prepare(hidden_th, topk_weights_tk, topk_ids_tk)
    pf.finalize(output_th, grouped_swiglu(rows, pf.layout))
    return rows


def decode_batch(rank: int, tokens: int, bucket: int, seed: int) -> dict[str, torch.Tensor]:
    """`tokens` real tokens padded to `bucket`: padding ids -1, padding rows and weights garbage."""
    x = step_inputs(rank, tokens, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    extra = bucket - tokens
    return dict(hidden=torch.cat([x["hidden"], torch.randn(extra, H, generator=gen, dtype=F64)]),
                weights=torch.cat([x["weights"], torch.rand(extra, K, generator=gen, dtype=F64)]),
                topk=torch.cat([x["topk"], torch.full((extra, K), -1, dtype=torch.int32)]))


def real_routes(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with the padding's weights zeroed (what the dense reference sums)."""
    return {**x, "weights": x["weights"] * (x["topk"] >= 0)}


def test_modular_kernel_contract_on_the_cpu():
    """Four ranks, decode batches of 0..bucket real tokens per rank padded to the bucket with -1: finalize
    writes the caller's output in place (the same tensor, every row rewritten), real tokens equal the dense
    reference, padding tokens are zero, and the per-group counts count every valid route exactly once, on
    the rank and group that computes it."""
    w13, w2 = model_weights()
    bucket = 8
    tokens_per_step = ((8, 3, 1, 0), (1, 1, 1, 1), (5, 8, 2, 7))

    def fn(world):
        comm = MoECommunicator(comm_config(dtype="float64"), world=world)
        layout = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="contract")
        pf = MoonEPPrepareAndFinalize(comm, layout, bucket)
        output_th = torch.empty(bucket, H, dtype=F64)
        results = []
        for seed, tokens_r in enumerate(tokens_per_step):
            x = decode_batch(world.rank, tokens_r[world.rank], bucket, seed)
            output_th.fill_(float("nan"))
            rows = modular_forward(pf, x["hidden"], x["weights"], x["topk"], output_th)
            counts = list(zip(rows.expert_ids_g.tolist(), rows.expert_num_tokens_g.tolist(), strict=True))
            results.append((x, output_th.clone(), counts))
        same_tensor = output_th.data_ptr()
        comm.destroy()
        return results, same_tensor

    outputs = run_ranks(fn, R)
    for step, tokens_r in enumerate(tokens_per_step):
        counted_e = torch.zeros(16, dtype=torch.long)
        routed_e = torch.zeros(16, dtype=torch.long)
        for rank in range(R):
            x, output_th, counts = outputs[rank][0][step]
            torch.testing.assert_close(output_th, dense_moe(real_routes(x), w13, w2), rtol=1e-12, atol=1e-9)
            assert not output_th[tokens_r[rank]:].any(), "padding tokens combine to zero"
            for expert, count in counts:
                if expert >= 0:
                    counted_e[expert] += count
                else:
                    assert count == 0, "an unused slot group is empty"
            ids = x["topk"][x["topk"] >= 0].long()
            routed_e += torch.bincount(ids, minlength=16)
        assert torch.equal(counted_e, routed_e), "every valid route counted once, on the group computing it"


@pytest.mark.gpu
def test_modular_kernel_contract_in_a_cuda_graph():
    """The same modular forward captured in one CUDA graph for the bucket (one rank on one GPU, float32),
    replayed with new decode batches of 1..bucket real tokens: the caller's output tensor holds the dense
    reference for the real tokens and zeros for the padding after each replay."""
    w13, w2 = model_weights()
    bucket = 16
    world = single_world("cuda")
    comm = MoECommunicator(comm_config(dtype="float32", check_expert_ids=False), world=world)
    assert bucket in comm.capacities and bucket < S
    layout = ExpertLayout.from_fused(world, w13, w2, num_slots=comm.num_slots, name="contract-graph",
                                     dtype=torch.float32)
    pf = MoonEPPrepareAndFinalize(comm, layout, bucket)
    static = {name: value.cuda().to(torch.int32 if name == "topk" else torch.float32)
              for name, value in decode_batch(0, bucket, bucket, seed=0).items()}
    output_th = torch.empty(bucket, H, device="cuda")

    def forward():
        modular_forward(pf, static["hidden"], static["weights"], static["topk"], output_th)

    graph = captured_graph(forward)
    for seed, tokens in enumerate((1, bucket, 5, 0, 11), start=1):
        x = decode_batch(0, tokens, bucket, seed)
        for name, value in x.items():
            static[name].copy_(value)
        output_th.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(output_th.cpu().double(), dense_moe(real_routes(x), w13, w2), rtol=1e-4,
                                   atol=1e-3)
        assert not output_th[tokens:].any(), "padding tokens combine to zero"
    comm.destroy()
