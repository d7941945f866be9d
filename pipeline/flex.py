"""flex_attention, compiled once per process (CUDA training; it has no CPU backward)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention as _eager

flex_attention = torch.compile(_eager, dynamic=False)
