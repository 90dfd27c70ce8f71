"""The public API: `from moonep_moe import ...` gives every name of `__all__`, each the object its module
defines; importing the package imports neither the optional `transformers` nor Triton; `__version__` is the
installed version, pyproject's."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import moonep_moe

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_name_is_the_object_of_its_module():
    assert {"MoonEPMoELayer", "MoEConfig", "load_config", "Buffer", "MoECommunicator", "ExpertLayout",
            "swap_moe_blocks", "hf_state_dict", "run_ranks"} <= set(moonep_moe.__all__)
    for name in moonep_moe.__all__:
        value = getattr(moonep_moe, name)
        assert getattr(sys.modules[value.__module__], name) is value, name
    namespace: dict = {}
    exec("from moonep_moe import *", namespace)
    assert set(moonep_moe.__all__) <= set(namespace)


def test_import_loads_neither_transformers_nor_triton():
    """In a fresh interpreter: the whole public API, the lazy names included, without the optional imports."""
    code = ("import sys; import moonep_moe; from moonep_moe import *; swap_moe_blocks, hf_state_dict; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'triton', 'deep_gemm'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_layer_trained_without_torch_compile_never_imports_torch_dynamo():
    """In a fresh interpreter: building a layer and a forward + backward leave torch._dynamo unimported
    (importing it costs about what importing torch does); only a forward that torch.compile traces needs it
    (`layers.compile_break`)."""
    code = ("import sys, torch; from moonep_moe import MoonEPMoELayer, load_config; "
            "layer = MoonEPMoELayer(load_config('tiny-cpu', ep_size=1)); "
            "layer(torch.randn(8, layer.config.hidden_size)).sum().backward(); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', "
            "'moonep_moe.layers.compile_break'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_version_is_the_installed_and_the_pyproject_version():
    try:
        installed = importlib.metadata.version("moonep-moe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("moonep-moe is not installed here (run from a source tree on PYTHONPATH, as on the GPU "
                    "machine): there is no installed version to compare")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert moonep_moe.__version__ == installed == version
