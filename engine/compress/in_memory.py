"""Keep a model's BF16 weights in the palette form on its device and expand each layer just before it runs.

Every decoder layer's large BF16 parameters (and an untied ``lm_head``) are replaced by views into ONE shared
buffer, as big as the largest such layer; a forward pre-hook on the layer expands that layer's weights into
it. Layers run one after another, so the buffer always holds the running layer's exact weights and the
outputs are bit for bit those of the uncompressed model. Memory: the palette forms (~1.33x smaller) plus
one layer in BF16. Cost: one expansion of every layer per forward step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.compress.palette import PaletteWeight, compress
from engine.compress.triton_expand import expand
from engine.model.errors import ModelLoadError

MIN_ELEMENTS = 1 << 12  # norms and other small tensors stay as they are
ALIGN = 64  # elements: each weight's view starts on a 128-byte boundary of the buffer


@dataclass
class CompressedLayers:
    """What ``keep_compressed`` did: the forms it holds, their sizes, and the hooks (``remove`` undoes
    nothing of the compression, it only stops the expansion)."""

    buffer: torch.Tensor
    forms: dict[str, PaletteWeight] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)

    @property
    def original_bytes(self) -> int:
        return 2 * sum(pw.numel for pw in self.forms.values())

    @property
    def compressed_bytes(self) -> int:
        """The palette forms alone."""
        return sum(pw.nbytes for pw in self.forms.values())

    @property
    def resident_bytes(self) -> int:
        """What the compressed weights occupy on the device: their forms plus the shared expansion buffer."""
        return self.compressed_bytes + self.buffer.numel() * self.buffer.element_size()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def keep_compressed(model: nn.Module, *, min_elements: int = MIN_ELEMENTS) -> CompressedLayers:
    """Compress ``model``'s decoder layers (``model.model.layers``) and untied ``lm_head`` in place."""
    groups: list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]] = []
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers to compress")
    modules: list[tuple[str, nn.Module]] = [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
    head = getattr(model, "lm_head", None)
    embedding = getattr(model.model, "embed_tokens", None)
    if isinstance(head, nn.Module) and (embedding is None or head.weight is not embedding.weight):
        modules.append(("lm_head", head))  # a tied head is the embedding, which is read outside any layer
    for prefix, module in modules:
        params = [
            (f"{prefix}.{name}", p)
            for name, p in module.named_parameters()
            if p.dtype == torch.bfloat16 and p.numel() >= min_elements
        ]
        if params:
            groups.append((module, params))
    if not groups:
        dtype = next(model.parameters()).dtype
        raise ModelLoadError(f"no bfloat16 weights to keep compressed: the model is {dtype} (use bfloat16)")
    device = groups[0][1][0][1].device
    size = max(_offsets(params)[-1] for _, params in groups)
    result = CompressedLayers(buffer=torch.empty(size, dtype=torch.bfloat16, device=device))
    with torch.no_grad():
        for module, params in groups:
            offsets = _offsets(params)
            jobs = []
            for (name, param), start in zip(params, offsets, strict=False):
                form = compress(param.data)
                result.forms[name] = form
                view = result.buffer[start : start + param.numel()].view(param.shape)
                param.data = view  # the BF16 copy goes; the parameter now reads the shared buffer
                jobs.append((form, view))
            result.hooks.append(module.register_forward_pre_hook(_expander(jobs)))
    return result


def _offsets(params: list[tuple[str, nn.Parameter]]) -> list[int]:
    """Each parameter's start in the buffer, then the end of the last one."""
    out = [0]
    for _, p in params:
        out.append(-(-(out[-1] + p.numel()) // ALIGN) * ALIGN)
    return out


def _expander(jobs: list[tuple[PaletteWeight, torch.Tensor]]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            for form, view in jobs:
                expand(form, view)

    return hook
