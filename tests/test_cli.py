"""The `moonep-moe` command: `--version`, `configs`, configs by name or path in every subcommand, user errors
as one line with exit status 2 found before any work starts (and a traceback with `--debug`), and `--resume`
keeping the checkpoint's global batch at any EP size."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import moonep_moe
import moonep_moe.apps.demo
import moonep_moe.apps.train
from moonep_moe.apps.cli import main
from moonep_moe.config import available_configs

ROOT = Path(__file__).resolve().parent.parent
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="needs transformers (the hf extra)")


@pytest.fixture(autouse=True)
def cpu(monkeypatch):
    """`train` as on a machine without a GPU (where there is one, it trains a single rank on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_work(monkeypatch):
    """Make any started demo or training run fail the test: errors must come before the work."""
    def started(*_, **__):
        raise AssertionError("the run started before the error was found")

    monkeypatch.setattr(moonep_moe.apps.demo, "run_demo", started)
    monkeypatch.setattr(moonep_moe.apps.train, "train", started)


def tiny_yaml(folder: Path, **train_fields) -> Path:
    """The packaged tiny-transformer with 2 sequences of 8 tokens per rank: a training config by path."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-transformer.yaml").read_text())
    data["train"].update({"batch_size": 2, "seq_len": 8, "ep_size": 2, **train_fields})
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_line(capsys) -> str:
    """The one line a user error printed: stdout empty (no header, nothing ran), stderr one line."""
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("moonep-moe: error: "), err
    return err


# --- --version, configs --------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    want = f"moonep-moe {moonep_moe.__version__} (torch {torch.__version__})\n"
    assert capsys.readouterr().out == want


def test_configs_lists_every_packaged_config_with_its_shape(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in available_configs():
        cfg = moonep_moe.load_config(name)
        (line,) = [line for line in lines if line.split()[0] == name]
        assert line.split()[1:6] == [str(v) for v in (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts,
                                                       cfg.top_k, cfg.ep_size)]
    (line,) = [line for line in lines if line.split()[0] == "tiny-transformer"]
    assert "Qwen3-MoE with 2 layers, H=64, E=8, K=2" in line


# --- configs by name or path, resolved inside the package ---------------------------------------------------


@needs_hf
@pytest.mark.parametrize("config", [[], ["--config", "tiny-transformer"]], ids=["default", "by-name"])
def test_train_finds_packaged_configs_outside_the_repo(config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *config, "--ranks", "1", "--steps", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("moonep-moe train: config tiny-transformer, ")


# --- the demo's output -----------------------------------------------------------------------------------


class Stream(io.StringIO):
    """One of the demo's streams on a terminal: it also copies all it is written to `screen`, as a
    terminal showing both stdout and stderr gets them."""

    def __init__(self, screen: io.StringIO):
        super().__init__()
        self.screen = screen

    def write(self, text: str) -> int:
        self.screen.write(text)
        return super().write(text)

    def isatty(self) -> bool:
        return True


def shown(text: str) -> list[str]:
    """`text`'s lines as a terminal leaves them: each carriage return writes over the line from its start."""
    lines = []
    for line in text.split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part):]
        lines.append(screen.rstrip())
    return lines


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str, str, str]:
    """`moonep-moe demo` run once with its defaults in an empty folder, both streams on a terminal: the
    folder, stdout, stderr, and both streams in the order they were written."""
    folder = tmp_path_factory.mktemp("demo")
    screen = io.StringIO()
    out, err = Stream(screen), Stream(screen)
    with (pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.chdir(folder)
        assert main(["demo"]) == 0
    return folder, out.getvalue(), err.getvalue(), screen.getvalue()


@pytest.mark.slow
def test_demo_writes_its_plot_into_an_output_folder(demo_run):
    folder, out, _, _ = demo_run
    assert sorted(p.name for p in folder.iterdir()) == ["moonep-out"]
    assert (folder / "moonep-out" / "moonep-demo.png").stat().st_size > 0
    assert out.splitlines()[-1].startswith("plot: moonep-out/moonep-demo.png   time: ")


@pytest.mark.slow
def test_demo_table_is_intact_with_the_progress_bar_on_the_same_terminal(demo_run):
    """stdout is the header, the table (column titles, rule, one row per skew level) and the summary, line
    after line; the bar is drawn on stderr and cleared before the table prints, so a terminal showing both
    streams shows exactly stdout's lines."""
    _, out, err, screen = demo_run
    lines = out.splitlines()
    assert "\r" not in out and "skew levels" not in out
    assert lines[0].startswith("moonep-moe demo: config tiny-cpu, ")
    assert lines[1].startswith("target maxvio (got) |") and set(lines[2]) == {"-"}
    rows = lines[3:3 + len(moonep_moe.apps.demo.SKEW_TARGETS)]
    assert [float(row.split()[0]) for row in rows] == list(moonep_moe.apps.demo.SKEW_TARGETS)
    assert lines[3 + len(rows)].startswith("outputs and gradients vs the dense float64 reference: ")
    assert lines[4 + len(rows):] == [lines[-1]] and lines[-1].startswith("plot: ")
    assert "skew levels: 100%" in err
    assert shown(screen) == shown(out)


def test_demo_draws_no_bar_into_a_log(capsys):
    """Where stderr is not a terminal (a CI log, a file), the sweep writes nothing to it."""
    moonep_moe.apps.demo.run_demo(moonep_moe.load_config("tiny-cpu"), targets=(0.0,))
    assert capsys.readouterr().err == ""


# --- user errors: one line, exit status 2, before any work ---------------------------------------------


def bad_yaml(folder: Path) -> Path:
    path = folder / "bad.yaml"
    path.write_text("hidden_size: 64\nrouter:\n  score_function: [softmax\n")
    return path


ERRORS = {
    "unknown-name": (["demo", "--config", "no-such-model"], "no packaged layer config named 'no-such-model'"),
    "missing-file": (["demo", "--config", "{tmp}/nowhere.yaml"], "nowhere.yaml"),
    "yaml-syntax": (["demo", "--config", "{tmp}/bad.yaml"], "bad.yaml, line 4"),
    "invalid-field": (["demo", "--ranks", "3"], "--config tiny-cpu --ranks 3: MoEConfig: num_experts (E=64) "
                                               "must be divisible by ep_size (R=3)"),
    "train-config-to-demo": (["demo", "--config", "tiny-transformer"], "is a training config"),
    "layer-config-to-train": (["train", "--config", "tiny-cpu"], "is a layer config"),
    "out-folder-missing": (["demo", "--out", "{tmp}/no-folder/plot.png"], "no-folder' does not exist"),
    "out-format": (["demo", "--out", "{tmp}/plot.txt"], "matplotlib cannot write .txt files"),
    "save-folder-missing": (["train", "--save", "{tmp}/no-folder/ckpt.pt"], "no-folder' does not exist"),
    "resume-missing": (["train", "--resume", "{tmp}/nowhere.pt"], "checkpoint not found"),
    "resume-not-a-checkpoint": (["train", "--resume", "{tmp}/bad.yaml"], "not a checkpoint torch.load can"),
    "ranks-with-collective": (["demo", "--world", "collective", "--ranks", "2"], "torchrun's processes"),
    "fp8-float32-model": (["train", "--precision", "fp8"],
                          "--precision fp8: config tiny-transformer trains in float32; FP8 experts need a "
                          "bfloat16 model"),
    "fp8-without-cuda": (["train", "--config", "small-transformer", "--precision", "fp8"],
                              "--precision fp8 cannot run here: FP8 experts run bf16 weights and activations "
                              "on CUDA, got torch.bfloat16 on cpu"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_user_errors_are_one_line_with_status_2_before_any_work(case, tmp_path, no_work, monkeypatch, capsys):
    argv, message = ERRORS[case]
    bad_yaml(tmp_path)
    if argv[0] == "train":
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message in error_line(capsys)
    assert not (tmp_path / "moonep-out").exists()  # nor is the demo's default output folder made


@pytest.mark.parametrize("argv", [["demo", "--world", "collective"], ["train", "--dp", "2"]],
                         ids=["demo-collective", "train-dp"])
def test_process_ranks_outside_torchrun_say_to_use_torchrun(argv, monkeypatch, no_work, capsys):
    """Ranks as processes need torchrun's environment; without it, say so (not torch's rendezvous error)."""
    if argv[0] == "train":
        pytest.importorskip("transformers")
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    assert main(argv) == 2
    given = " ".join(argv[1:])
    assert error_line(capsys) == (f"moonep-moe: error: {given}: the ranks are processes; run it under "
                                  f"torchrun, e.g. torchrun --nproc-per-node 4 -m moonep_moe.apps.cli "
                                  f"{' '.join(argv)}\n")


@needs_hf
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_precision_becomes_the_runs_moe_override(precision, monkeypatch, capsys):
    """`--precision` becomes the `moe:` override `precision` of the run (fp8 as on a machine where it can
    run) and the header says so. The check is asked about the segment alignment the fp8 layer will get
    (128, the fp8 default, when the config leaves token_padding out: None was refused as unaligned)."""
    import moonep_moe.gemm.registry

    runs, checked = [], []
    monkeypatch.setattr(moonep_moe.gemm.registry, "fp8_unsupported_reason",
                        lambda device, dtype, token_padding: checked.append(token_padding))
    monkeypatch.setattr(moonep_moe.apps.train, "train", lambda cfg, **_: runs.append(cfg) or {"losses": []})
    assert main(["train", "--config", "small-transformer", "--precision", precision, "--quiet"]) == 0
    (cfg,) = runs
    assert cfg.moe["precision"] == precision and cfg.train.dtype == "bfloat16"
    assert checked == ([128] if precision == "fp8" else [])
    header = capsys.readouterr().out
    assert header.startswith("moonep-moe train: config small-transformer, Qwen3-MoE with 2 layers, H=256, "
                             "E=8, K=2, vocab=128, bfloat16")
    assert ("fp8 experts" in header) == (precision == "fp8")


def test_debug_shows_the_traceback(no_work):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        main(["demo", "--config", "no-such-model", "--debug"])


def test_the_command_prints_no_traceback():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "moonep_moe.apps.cli", "demo", "--config", "no-such-model"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("moonep-moe: error: no packaged layer config")


COUNTS = {"demo-ranks": ["demo", "--ranks", "0"], "train-ranks": ["train", "--ranks", "0"],
          "train-steps": ["train", "--steps", "0"]}


@pytest.mark.parametrize("case", COUNTS)
def test_counts_below_one_are_refused_not_replaced(case, no_work, capsys):
    argv = COUNTS[case]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"argument {argv[1]}: must be at least 1, got 0" in capsys.readouterr().err


def test_train_without_transformers_says_how_to_install(monkeypatch, no_work, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["train"]) == 2
    assert "pip install 'moonep-moe[hf]'" in error_line(capsys)


@needs_hf
def test_train_on_a_gpu_refuses_several_ranks(monkeypatch, no_work, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["train", "--ranks", "2"]) == 2
    assert "--ranks 2: on a GPU, train runs one rank" in error_line(capsys)


# --- --resume -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny training config (2 ranks x 2 sequences: global batch 4) and its checkpoint at step 2."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("resume")
    config, ckpt = tiny_yaml(folder), folder / "step2.pt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        assert main(["train", "--config", str(config), "--steps", "2", "--save", str(ckpt), "--quiet"]) == 0
    return config, ckpt


def resume(checkpoint: tuple[Path, Path], *args: str) -> list[str]:
    config, ckpt = checkpoint
    return ["train", "--config", str(config), "--resume", str(ckpt), *args]


@pytest.mark.parametrize("steps", ["1", "2"])
def test_steps_not_beyond_the_checkpoint_are_refused(steps, checkpoint, no_work, capsys):
    assert main(resume(checkpoint, "--steps", steps)) == 2
    assert f"steps={steps} is not beyond the checkpoint's step 2: nothing to train" in error_line(capsys)


@pytest.mark.parametrize("ranks", [1, 4])
def test_resume_at_another_ep_size_keeps_the_global_batch(ranks, checkpoint, tmp_path, monkeypatch, capsys):
    sample_batch, rows = moonep_moe.apps.train.sample_batch, []

    def spy(probs_vv, cfg, step, rank):
        rows.append(cfg.batch_size)
        return sample_batch(probs_vv, cfg, step, rank)

    monkeypatch.setattr(moonep_moe.apps.train, "sample_batch", spy)
    saved = tmp_path / "step3.pt"
    argv = resume(checkpoint, "--steps", "3", "--ranks", str(ranks), "--save", str(saved), "--quiet")
    assert main(argv) == 0
    assert rows == [4 // ranks] * ranks  # step 3 only, on every rank
    assert torch.load(saved, weights_only=True)["global_batch"] == 4
    assert f"{4 // ranks} sequences of 8 tokens per rank (the checkpoint's global batch of 4)" in \
        capsys.readouterr().out


def test_resume_refuses_a_global_batch_the_ranks_do_not_divide(checkpoint, no_work, capsys):
    assert main(resume(checkpoint, "--steps", "3", "--ranks", "3")) == 2
    assert "global batch of 4 sequences does not split evenly over 3 EP ranks" in error_line(capsys)
