"""bench/comm_kernels.py end to end on the CPU (a smoke test of the script: host time of torch ops)."""

import json

from bench.comm_kernels import main


def test_cpu_smoke_run_writes_a_row_of_ops_per_token_count(tmp_path, capsys):
    path = main(["--hidden", "32", "--experts", "8", "--top-k", "2", "--tokens", "4", "--reps", "5",
                 "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["benchmark"] == "comm-kernels" and record["device"] == "cpu"
    assert record["shape"] == dict(H=32, E=8, K=2, S=4, dtype="bfloat16", token_padding=16)
    rows = record["results"]
    assert [row["tokens"] for row in rows] == [1, 2, 4]
    for row in rows:
        assert row["eager"] and all(us >= 0 for us in row["eager"].values())
        assert sum(row["eager"].values()) > 0
        assert "graph" not in row  # no CUDA graph on the CPU
    assert f"wrote {path}" in capsys.readouterr().out
