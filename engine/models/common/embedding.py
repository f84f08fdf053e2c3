"""The token embedding both families use."""
from __future__ import annotations

from torch import nn


class TokenEmbedding(nn.Embedding):
    """nn.Embedding without its random init: the table always comes from a checkpoint. Skipping
    `normal_` also keeps a build on the meta device from importing torch's reference ops
    (torch._dynamo, ~2.4 s of CPU in every worker process that loads a model)."""

    def reset_parameters(self) -> None:
        pass
