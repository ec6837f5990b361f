"""The depth predictor (docs/design.md, "egt"), evaluated in plain torch: the runtime never imports
scikit-learn, which trains it at compile time (`ygg_compile.predictor_training`).

A small MLP reads the target's final hidden state at the last accepted position and gives, for
d = 1..D_max, P(the accepted length is at least d): how far a deep tree would be accepted after
this context. The objective turns those into tokens per step for each depth and picks the depth
(`objective.best_depth`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from ygg_runtime.errors import YggError
from ygg_runtime.transfer import to_host


class DepthPredictor:
    """Standardise, then ReLU hidden layers, then one sigmoid per depth (scikit-learn's
    MLPClassifier in multi-label mode, exported as `mean`, `scale`, `w0`, `b0`, `w1`, ...)."""

    def __init__(self, tensors: dict[str, Tensor]):
        try:
            self.mean, self.scale = tensors["mean"].float(), tensors["scale"].float()
            n = sum(1 for k in tensors if k.startswith("w"))
            self.layers = [(tensors[f"w{i}"].float(), tensors[f"b{i}"].float()) for i in range(n)]
        except KeyError as e:
            raise YggError(f"the depth predictor lacks its tensor {e}: recompile") from None
        if not self.layers or self.layers[0][0].shape[0] != self.mean.shape[0]:
            raise YggError("the depth predictor's weights do not fit together: recompile")

    @classmethod
    def load(cls, path: Path) -> "DepthPredictor":
        try:
            return cls(load_file(str(path)))
        except (OSError, SafetensorError) as e:
            raise YggError(f"cannot read the depth predictor {path}: {e}") from None

    @property
    def max_depth(self) -> int:
        return self.layers[-1][0].shape[1]

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    @torch.inference_mode()
    def raw(self, hidden: Tensor) -> Tensor:
        """The heads' probabilities [..., D_max] exactly as the trained model gives them, computed
        where `hidden` is (the weights follow it there once)."""
        if self.mean.device != hidden.device:
            self.mean, self.scale = self.mean.to(hidden.device), self.scale.to(hidden.device)
            self.layers = [(w.to(hidden.device), b.to(hidden.device)) for w, b in self.layers]
        x = (hidden.float() - self.mean) / self.scale
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            x = torch.relu(x) if i + 1 < len(self.layers) else torch.sigmoid(x)
        return x

    def reach(self, hidden: Tensor) -> list[float]:
        """P(accepted length >= d) for d = 1..D_max (one read; `monotone`)."""
        return self.monotone(to_host(self.raw(hidden)))

    @staticmethod
    def monotone(heads: list[float]) -> list[float]:
        """The heads' probabilities made non-increasing in d: the reach (the heads are trained
        separately, so a deeper head may come out a hair above a shallower one)."""
        out, low = [], 1.0
        for p in heads:
            low = min(low, p)
            out.append(low)
        return out
