"""The grouped output projection both families use (`wo_a`: one block per group of heads)."""

from __future__ import annotations

import torch
from torch import nn


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: each of `groups` input slices has its own [out/groups, in] block."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in_per_group] -> [T, groups * out_per_group]."""
        weight = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("tgi,goi->tgo", x, weight).flatten(1)


def linear_groups(linear: nn.Linear) -> int:
    """How many independent row blocks a linear's weight holds (1 for a plain nn.Linear)."""
    return linear.groups if isinstance(linear, GroupedLinear) else 1
