"""flex_attention, compiled once per process (CUDA training; it has no CPU backward)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention as _eager

# Training pads anchors and buckets context lengths (stages/train.py), so shapes repeat; allow a few
# more cached graphs than the default (batch size can also vary at window tails).
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
flex_attention = torch.compile(_eager, dynamic=False)
