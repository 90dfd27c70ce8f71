"""Shared test settings."""

import torch

# Thread-ranks run R Python threads on a 2-core CI machine: nested intra-op OpenMP threads only
# oversubscribe it (and make timings erratic), so every op runs single-threaded.
torch.set_num_threads(1)
