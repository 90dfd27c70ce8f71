"""bench/step_bytes.py: ncu's report read back, each kernel given the GEMM call around it, the totals, and
the roles a real step of our layer brackets."""

import argparse
import subprocess
import sys

import pytest
import torch

from bench import step_bytes
from bench.common import config_field, config_suffix
from moonep_moe.config import MoEConfig
from moonep_moe.layers.moe import MoonEPMoELayer
from moonep_moe.transport.threads import single_world

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"')
UNITS = '"","","","","","","","","","","","byte","byte","nsecond"'


def line(i: int, name: str, read: str, write: str, ns: str) -> str:
    launch = '"1","7","(1, 1, 1)","(1, 1, 1)","0","9.0"'
    return f'"{i}","7","python3","h","{name}",{launch},"{read}","{write}","{ns}"'


REPORT = "\n".join([
    "==PROF== Connected to process 7",
    HEADER, UNITS,
    line(0, "elementwise_kernel", "1000", "2,000", "5,000"),
    line(1, "spin_kernel(long)", "0", "0", "1000"),
    line(2, "cutlass_grouped_gemm", "3,000,000", "1000", "2,000,000"),
    line(3, "splitKreduce_kernel", "500", "500", "1000"),
    line(4, "spin_kernel(long)", "0", "0", "1000"),
    line(5, "swiglu_kernel", "100", "100", "3000"),
    line(6, "spin_kernel(long)", "0", "0", "1000"),
    line(7, "cutlass_grouped_gemm", "8,000,000", "4,000", "4,000,000"),
    line(8, "spin_kernel(long)", "0", "0", "1000"),
    "==PROF== Disconnected from process 7",
])


def test_the_report_is_read_kernel_by_kernel_past_ncus_messages_and_units_row():
    kernels = step_bytes.parse_ncu_csv(REPORT)
    names = [k["name"] for k in kernels]
    assert names[:3] == ["elementwise_kernel", "spin_kernel(long)", "cutlass_grouped_gemm"]
    assert len(kernels) == 9
    assert kernels[0] == {"name": "elementwise_kernel", "ms": 0.005, "read_bytes": 1e3, "write_bytes": 2e3}
    assert kernels[7]["read_bytes"] == 8e6 and kernels[7]["ms"] == 4.0
    with pytest.raises(ValueError, match="no report header"):
        step_bytes.parse_ncu_csv("==PROF== nothing profiled")


def test_kernels_between_a_marker_pair_take_that_calls_role_and_the_markers_are_dropped():
    roles = [{"role": "fwd gate_up", "flops": 4e9, "weight_bytes": 2e6},
             {"role": "fwd down", "flops": 2e9, "weight_bytes": 2e6}]
    kernels = step_bytes.attribute_roles(step_bytes.parse_ncu_csv(REPORT), roles)
    assert [(k["name"], k["role"]) for k in kernels] == [
        ("elementwise_kernel", None), ("cutlass_grouped_gemm", "fwd gate_up"),
        ("splitKreduce_kernel", "fwd gate_up"), ("swiglu_kernel", None), ("cutlass_grouped_gemm", "fwd down")]
    with pytest.raises(ValueError, match="4 marker kernels for 3 GEMM calls"):
        step_bytes.attribute_roles(step_bytes.parse_ncu_csv(REPORT), roles + roles[:1])

    summary = step_bytes.summarise(kernels, roles)
    assert summary["launches"] == 5
    assert summary["read_gb"] == pytest.approx((1000 + 3e6 + 500 + 100 + 8e6) / 1e9)
    gate_up = summary["roles"]["fwd gate_up"]
    assert gate_up["launches"] == 2 and gate_up["ms"] == pytest.approx(2.001)
    assert gate_up["read_over_weights"] == pytest.approx((3e6 + 500) / 2e6)
    assert summary["roles"]["fwd down"]["read_over_weights"] == pytest.approx(4.0)
    assert summary["roles"]["fwd down"]["tflops_serial"] == pytest.approx(2e9 / 4e-3 / 1e12)
    assert summary["groups"]["GEMMs"]["launches"] == 3  # the split-K reduce is a GEMM kernel too
    assert summary["groups"]["elementwise"]["launches"] == 2


def test_a_real_step_brackets_every_gemm_call_with_its_role_and_operand_bytes(monkeypatch):
    """Our layer's step on the CPU: the six calls of the expert block in the backward's order, each between
    two markers, with the weights it reads (fwd, dgrad) or the gradients it makes (wgrad)."""
    hidden, ffn, experts = 64, 32, 4
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=2,
                    max_tokens_per_rank=16)
    layer = MoonEPMoELayer(cfg, single_world("cpu"))
    marks = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: marks.append(cycles))
    calls = step_bytes.bracket_gemm_calls(layer, hidden, ffn)
    x = torch.randn(16, hidden, dtype=cfg.torch_dtype, requires_grad=True)
    layer(x).backward(torch.randn(16, hidden, dtype=cfg.torch_dtype))
    assert [call["role"] for call in calls] == ["fwd gate_up", "fwd down", "dgrad down", "wgrad down",
                                                "dgrad gate_up", "wgrad gate_up"]
    assert len(marks) == 2 * len(calls)
    assert [(call["cols"], call["inner"]) for call in calls][:2] == [(2 * ffn, hidden), (hidden, ffn)]
    sizes = [step_bytes.call_sizes(call) for call in calls]
    offs_g = calls[0]["offs_g"].long()
    rows, used = int(offs_g[-1]), int((torch.diff(offs_g, prepend=offs_g.new_zeros(1)) > 0).sum())
    assert rows >= 16 * 2 and used >= 1, "every route has its row"
    gate_up, down = 2 * ffn * hidden, hidden * ffn  # one group's matrix, elements
    assert [size["weight_bytes"] for size in sizes] == [used * n * 2 for n in (gate_up, down, down, down,
                                                                              gate_up, gate_up)]
    assert [size["flops"] for size in sizes] == [2 * rows * n for n in (gate_up, down, down, down, gate_up,
                                                                         gate_up)]


def test_a_group_without_rows_is_left_out_of_the_weights_read():
    """An unused slot's weights are never read: only groups with rows count, and the FLOPs are the rows up
    to the last group's end."""
    call = {"role": "fwd down", "cols": 8, "inner": 4, "element_size": 2,
            "offs_g": torch.tensor([16, 16, 48, 48, 64], dtype=torch.int32)}
    expected = {"role": "fwd down", "flops": 2 * 64 * 32, "weight_bytes": 3 * 32 * 2}  # groups 0, 2, 4
    assert step_bytes.call_sizes(call) == expected


def test_cpu_run_names_the_missing_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run")
    run = subprocess.run([sys.executable, "-m", "bench.step_bytes"], capture_output=True, text=True)
    assert run.returncode == 2 and "needs a GPU" in run.stderr


def test_config_fields_are_parsed_as_yaml_values_name_the_record_and_a_bad_one_is_refused():
    """`bench.common.config_field` and `config_suffix`: the `--config` of bench.step_bytes, bench.memory."""
    assert config_field("token_padding=128") == ("token_padding", 128)
    assert config_field("grouped_gemm=deep_gemm") == ("grouped_gemm", "deep_gemm")
    fields = dict(map(config_field, ["precision=fp8", "token_padding=128", "fp8_dispatch=true"]))
    assert fields == {"precision": "fp8", "token_padding": 128, "fp8_dispatch": True}
    assert config_suffix(fields) == "-precision-fp8-token_padding-128-fp8_dispatch-True"
    assert config_suffix({}) == ""
    for bad in ("token_padding", "=128"):
        with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
            config_field(bad)
