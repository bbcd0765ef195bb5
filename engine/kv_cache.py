"""The paged KV cache's storage: per layer, one K and one V tensor of ``num_blocks * block_size`` slots."""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVCache:
    """Per-layer K and V tensors of ``num_blocks * block_size`` slots each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Called after each layer has stored its K/V: lets a prefill engine send that layer at once.
        self.on_layer_stored: Callable[[int], None] | None = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def layer_stored(self, i: int) -> None:
        if self.on_layer_stored is not None:
            self.on_layer_stored(i)
