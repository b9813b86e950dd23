"""Trained early-exit heads: a small translator in front of the model's own final norm and LM head.

An exit head maps the residual stream after ``b`` decoder layers (hidden ``[m, d]``) to logits ``[m, V]`` over the
full vocabulary (the :data:`hsd_opt.engine.layered.ExitHead` contract):

- ``affine`` (the "tuned lens"): ``h' = h + W h + c`` with ``W`` ``[d, d]`` initialised to 0, then the shared
  final norm and LM head. At initialisation the head is exactly the raw logit lens.
- ``lowrank``: the same with ``W = U V`` (``U`` ``[d, r]`` initialised 0, ``V`` ``[r, d]``): ``2 r d`` parameters.
- reduced vocabulary (``vocab_ids``, any kind): the LM head is applied only to the ``K`` rows of ``vocab_ids``
  (the most frequent tokens of the training text), so a shallow exit's head costs ``d K`` instead of ``d V``.
  The head returns full-vocabulary logits with ``-inf`` outside the subset: its softmax is a proper
  distribution supported on the subset, which keeps speculative sampling lossless (the target only needs
  ``q(x) > 0`` for the tokens the draft actually proposes).

The heads own only their translator parameters (and the subset ids); the norm and LM head are the model's, used
by reference and never saved.
"""

from __future__ import annotations

import torch
from torch import nn

from hsd_opt.heads.settings import KINDS


class TranslatorHead(nn.Module):
    """One exit head. Callable: hidden ``[m, d]`` (any float dtype) -> logits ``[m, V]`` in the model's dtype.

    Args:
        model: the ``transformers`` causal LM whose ``model.norm`` and ``lm_head`` are shared.
        kind: ``"affine"`` or ``"lowrank"``.
        rank: rank of ``W`` for ``lowrank``.
        vocab_ids: optional 1-D long tensor of token ids: the draft vocabulary.
    """

    def __init__(self, model, kind: str = "affine", rank: int = 64, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        d = model.config.hidden_size
        self.kind, self.rank, self.hidden_size = kind, int(rank), d
        # Shared modules by reference (a tuple keeps them out of this module's parameters and state_dict).
        self._shared = (model.model.norm, model.lm_head)
        lm_w = model.lm_head.weight
        self.vocab_size = lm_w.shape[0]
        dev = lm_w.device
        if kind == "affine":
            self.weight = nn.Parameter(torch.zeros(d, d, device=dev))
        else:
            self.u = nn.Parameter(torch.zeros(d, self.rank, device=dev))
            self.v = nn.Parameter(torch.randn(self.rank, d, device=dev) / d ** 0.5)
        self.bias = nn.Parameter(torch.zeros(d, device=dev))
        if vocab_ids is not None:
            ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=dev).reshape(-1)
            self.register_buffer("vocab_ids", ids)
            self.register_buffer("sub_weight", lm_w.detach()[ids].clone(), persistent=False)
            lm_b = getattr(model.lm_head, "bias", None)
            self.register_buffer("sub_bias", None if lm_b is None else lm_b.detach()[ids].clone(), persistent=False)
        else:
            self.vocab_ids = None
            self.sub_weight = None
            self.sub_bias = None

    # ------------------------------------------------------------------------------------------ pieces

    @property
    def norm(self):
        return self._shared[0]

    @property
    def lm_head(self):
        return self._shared[1]

    def translate(self, hidden: torch.Tensor) -> torch.Tensor:
        """``h + W h + c`` in float32, then the shared final norm (output in the norm's dtype)."""
        h = hidden.float()
        if self.kind == "affine":
            h = h + h @ self.weight.T + self.bias
        else:
            h = h + (h @ self.v.T) @ self.u.T + self.bias
        w = self.lm_head.weight
        return self.norm(h.to(w.dtype))

    def project(self, normed: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """LM head rows ``ids`` (all rows when None) applied to normalised hidden states -> logits ``[m, |ids|]``."""
        if ids is None:
            return self.lm_head(normed)
        w = self.lm_head.weight[ids]
        b = getattr(self.lm_head, "bias", None)
        return torch.nn.functional.linear(normed, w, None if b is None else b[ids])

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary: ``[m, K]`` for a reduced-vocabulary head, else ``[m, V]``."""
        n = self.translate(hidden)
        if self.vocab_ids is None:
            return self.lm_head(n)
        return torch.nn.functional.linear(n, self.sub_weight, self.sub_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.subset_logits(hidden)
        if self.vocab_ids is None:
            return z
        out = torch.full((z.shape[0], self.vocab_size), float("-inf"), dtype=z.dtype, device=z.device)
        out[:, self.vocab_ids] = z
        return out

    def extra_repr(self) -> str:
        k = "full" if self.vocab_ids is None else str(self.vocab_ids.numel())
        return f"kind={self.kind}, d={self.hidden_size}, rank={self.rank if self.kind == 'lowrank' else '-'}, vocab={k}"


class RawHead:
    """The untrained logit lens (the model's final norm + LM head), optionally over a vocabulary subset. Callable:
    hidden ``[m, d]`` (any float dtype; cast to the LM head's, as :meth:`TranslatorHead.translate` does) -> logits
    ``[m, V]`` in the model's dtype."""

    def __init__(self, model, vocab_ids: torch.Tensor | None = None):
        self.norm, self.lm_head = model.model.norm, model.lm_head
        self.vocab_size = self.lm_head.weight.shape[0]
        self.vocab_ids = vocab_ids
        if vocab_ids is not None:
            self.sub_weight = self.lm_head.weight.detach()[vocab_ids].clone()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        n = self.norm(hidden.to(self.lm_head.weight.dtype))
        if self.vocab_ids is None:
            return self.lm_head(n)
        z = n @ self.sub_weight.T
        out = torch.full((z.shape[0], self.vocab_size), float("-inf"), dtype=z.dtype, device=z.device)
        out[:, self.vocab_ids] = z
        return out
