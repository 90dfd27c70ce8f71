"""How DeepGEMM loads on this machine: which libstdc++ the process maps, and which import order works.

    python -m bench.deep_gemm_probe

Each variant runs in its own interpreter (a crash there cannot take this one down) and prints its exit
code: 0 = DeepGEMM's JIT initialised and a grouped GEMM ran; -11 = the std::regex segfault.
"""

from __future__ import annotations

import os
import subprocess
import sys

SYSTEM_LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
MAPS = "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}))"
RUN = ("import deep_gemm, torch; print('sms', deep_gemm.get_num_sms()); "
       "a = torch.randn(256, 256, device='cuda', dtype=torch.bfloat16); "
       "b = torch.randn(2, 256, 256, device='cuda', dtype=torch.bfloat16); "
       "d = torch.empty(256, 256, device='cuda', dtype=torch.bfloat16); "
       "offs = torch.tensor([128, 256], dtype=torch.int32, device='cuda'); "
       "deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offs, use_psum_layout=True); "
       "print('err', float((d[:128] - a[:128] @ b[0].T).abs().max()))")
PRELOAD = f"import ctypes; ctypes.CDLL({SYSTEM_LIBSTDCXX!r}, mode=ctypes.RTLD_GLOBAL); "
VARIANTS = {
    "maps after import torch": ("import torch; " + MAPS, {}),
    "maps after import deep_gemm": ("import torch, deep_gemm; " + MAPS, {}),
    "plain": ("import torch; " + RUN, {}),
    "ctypes preload before torch": (PRELOAD + "import torch; " + RUN, {}),
    "ctypes preload after torch": ("import torch; " + PRELOAD + RUN, {}),
    "LD_PRELOAD": ("import torch; " + RUN, {"LD_PRELOAD": SYSTEM_LIBSTDCXX}),
}


def main() -> None:
    for name, (code, env) in VARIANTS.items():
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env})
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        print(f"{name:30} rc={done.returncode:4}  {' | '.join(tail)}", flush=True)


if __name__ == "__main__":
    main()
