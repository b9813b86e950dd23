"""Loaded weights are moved into one resident buffer (same values, same ties, one storage), and pages of
released weights inside it go back to the OS."""

from __future__ import annotations

import torch

from hsd_opt.models.memory import drop_pages, resident_weights
from tests.helpers import make_tiny_llama


def test_weights_move_into_one_buffer_keeping_values_and_ties():
    model = make_tiny_llama(seed=2)
    model.lm_head.weight = model.model.embed_tokens.weight          # tie them, as SmolLM2 does
    ids = torch.tensor([[5, 9, 3, 7]])
    before = model(ids).logits
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = resident_weights(model)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1 and moved >= sum(v.numel() * 4 for v in values.values())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    assert torch.equal(model(ids).logits, before)
    assert resident_weights(model.to("meta")) == 0                   # not on the CPU: left alone


def test_drop_pages_gives_back_a_view_of_a_buffer():
    buf = torch.ones(64 * 4096, dtype=torch.uint8)
    base = buf.data_ptr()
    start = (-base) % 4096 + 4096                                   # a page boundary inside the buffer
    view = buf[start: start + 3 * 4096 + 100]
    assert drop_pages(view) == 3 * 4096 and int(view[: 3 * 4096].sum()) == 0     # the pages read zeros now
    assert int(buf[:start].sum()) == start and int(view[3 * 4096:].sum()) == 100  # nothing else changed
    assert drop_pages(torch.ones(3 * 4096, dtype=torch.uint8)) == 0              # owns its storage
