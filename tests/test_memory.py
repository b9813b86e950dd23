"""Loaded weights are moved into one resident buffer (same values, same ties, one storage), or in parts (what is
moved stays), and pages of released weights inside it go back to the OS. A model loaded for the engines alone has
its matrices moved only when a float engine reads them in place."""

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


def test_weights_move_in_parts_and_once():
    model = make_tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 3, 7]])
    before = model(ids).logits
    small = lambda name: not name.endswith("_proj.weight")                      # noqa: E731
    first = resident_weights(model, which=small)
    q = model.model.layers[0].self_attn.q_proj.weight
    embed_at, q_at = model.model.embed_tokens.weight.data_ptr(), q.data_ptr()
    rest = resident_weights(model)                                  # the projections now; the rest stays
    assert first > 0 and rest >= sum(p.numel() * 4 for n, p in model.named_parameters() if not small(n))
    assert model.model.embed_tokens.weight.data_ptr() == embed_at and q.data_ptr() != q_at
    assert resident_weights(model) == 0                             # everything moved: nothing more
    assert torch.equal(model(ids).logits, before)


def test_a_model_for_the_engines_has_its_matrices_moved_when_a_float_engine_reads_them(tmp_path):
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.models.loading import load_model
    from tests.helpers import save_tiny

    loaded = load_model(str(save_tiny(tmp_path / "m", seed=4)), device="cpu", dtype="float32", engines_only=True)
    m = loaded.model
    q = m.model.layers[1].mlp.down_proj.weight
    embed_at, q_at = m.model.embed_tokens.weight.data_ptr(), q.data_ptr()
    assert resident_weights(m, which=lambda name: name == "model.embed_tokens.weight") == 0   # moved at load
    LayeredLM(m)
    assert q.data_ptr() != q_at and m.model.embed_tokens.weight.data_ptr() == embed_at
    assert resident_weights(m) == 0


def test_a_float_engine_leaves_a_model_built_in_memory_where_it_is():
    from hsd_opt.engine.layered import LayeredLM

    model = make_tiny_llama(seed=6)
    q = model.model.layers[0].self_attn.q_proj.weight
    at = q.data_ptr()
    LayeredLM(model)
    assert q.data_ptr() == at                                       # never made resident: not moved by an engine


def test_drop_pages_gives_back_a_view_of_a_buffer():
    buf = torch.ones(64 * 4096, dtype=torch.uint8)
    base = buf.data_ptr()
    start = (-base) % 4096 + 4096                                   # a page boundary inside the buffer
    view = buf[start: start + 3 * 4096 + 100]
    assert drop_pages(view) == 3 * 4096 and int(view[: 3 * 4096].sum()) == 0     # the pages read zeros now
    assert int(buf[:start].sum()) == start and int(view[3 * 4096:].sum()) == 100  # nothing else changed
    assert drop_pages(torch.ones(3 * 4096, dtype=torch.uint8)) == 0              # owns its storage



def test_projections_the_kernels_read_in_an_exact_form_stay_in_the_files_pages(embedded):
    """SmolLM2's projections are exact in int4 (a de-quantized Q4_1 file): its float engine on the kernels reads
    those forms, so a model loaded for the engines alone keeps exactly its float32 projections in the file's pages
    (no copy of ~400 MB at start) and moves the rest; the engine's logits are bit for bit those of an engine over
    the model made wholly resident."""
    import pytest

    from hsd_opt.engine import kernels
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.weights import linears
    from hsd_opt.models.loading import load_model

    lib = kernels.load()
    if lib is None or lib.hsd_simd() < 1:
        pytest.skip("no SIMD kernels here: the engine reads the float32 weights, all of them resident")
    m = load_model("smollm2-135m", device="cpu", dtype="float32", engines_only=True).model
    projections = [lin.weight for layer in m.model.layers for lin in linears(layer).values()]
    at = [w.data_ptr() for w in projections]
    eng, whole = LayeredLM(m), LayeredLM(embedded.model)
    assert [w.data_ptr() for w in projections] == at                # read in their exact forms: left in place
    ids = [1, 9690, 28, 2634, 314, 253, 1345, 30]
    out = []
    for e in (eng, whole):
        st = e.new_state(64)
        e.append(st, ids)
        e.advance(st, e.n_layers)
        out.append(e.logits(st, e.n_layers, 0, len(ids)))
    assert torch.equal(out[0], out[1])
    assert resident_weights(m) == sum(w.numel() * w.element_size() for w in projections)   # only they were left
