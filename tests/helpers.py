"""What several test files share: tiny models, the CLI with its output, deterministic token drafters, random
solver instances. Plain functions and classes (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from typer.testing import CliRunner

from hsd_opt.drafters.base import TokenDrafter
from hsd_opt.formats import Profile, profile_from_dict

# ------------------------------------------------------------------------------------------------ tiny models


def make_tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 4, hidden: int = 32, heads: int = 4,
                    kv_heads: int = 2, scale: float = 1.0):
    """A randomly initialised ``LlamaForCausalLM`` small enough for exhaustive tests (float32, CPU, eval).

    ``scale`` multiplies the initial weight std (larger = peakier next-token distributions).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, initializer_range=0.02 * scale, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


#: A chat template for :func:`save_tiny`'s word-level tokenizer (roles are unknown words there).
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                      "{% if add_generation_prompt %}<s> assistant {% endif %}")


def modules_logits(model, eng, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of ``ids`` computed through ``model``'s own modules (its embedding, each layer's norms, projections
    and MLP, its final norm and head, called as modules in the order of the Hugging Face forward), with ``eng``'s
    rotary tables and caches: a pass over ``ids[:split]``, then one step per token. The reference the engine's
    torch path equals bit for bit."""
    from hsd_opt.engine.ops import causal_attention, rotate_half

    st = eng.new_state(len(ids) + 1)
    out, pos = [], 0
    with torch.no_grad():
        for chunk in [ids[:split]] + [ids[i:i + 1] for i in range(split, len(ids))]:
            m = chunk.numel()
            cos, sin = eng.rope(pos, pos + m)
            x = model.model.embed_tokens(chunk)
            for l, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(m, eng.n_heads, eng.head_dim).transpose(0, 1)
                k = attn.k_proj(h).view(m, eng.n_kv, eng.head_dim).transpose(0, 1)
                v = attn.v_proj(h).view(m, eng.n_kv, eng.head_dim).transpose(0, 1)
                if hasattr(attn, "q_norm"):  # Qwen3
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                st.k[l][0, :, pos:pos + m], st.v[l][0, :, pos:pos + m] = k, v
                o = causal_attention(q.unsqueeze(0), st.k[l][:, :, :pos + m], st.v[l][:, :, :pos + m], pos)
                x = x + attn.o_proj(o[0].transpose(0, 1).reshape(m, eng.n_heads * eng.head_dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append(model.lm_head(model.model.norm(x)).float())
            pos += m
    return torch.cat(out)


def engine_logits(eng, ids: torch.Tensor, split: int) -> torch.Tensor:
    """The engine's logits of ``ids`` as :func:`modules_logits` computes them: a pass over ``ids[:split]``, then
    one step per token, the head applied to each pass's positions."""
    st = eng.new_state(len(ids) + 1)
    out = []
    for chunk in [ids[:split]] + [ids[i:i + 1] for i in range(split, len(ids))]:
        n0 = st.n
        eng.append(st, chunk)
        eng.advance(st, eng.n_layers)
        out.append(eng.logits(st, eng.n_layers, n0, st.n))
    return torch.cat(out)


def stepwise_greedy(eng, prompt, n: int, eos=(), constraint=None) -> list[int]:
    """The target's greedy tokens read one step at a time off ``eng``'s logits at its last layer (the argmax of the
    row, computed whole: no decoding loop, no greedy screen, no verify pass), ending after a token of ``eos``:
    the reference a decoder's greedy output must equal. ``prompt``: token ids; at most ``n`` new tokens;
    ``constraint``: a grammar's state (:class:`~hsd_opt.grammar.constraint.Constraint`) masking each row."""
    st = eng.new_state(len(prompt) + n + 1)
    eng.append(st, torch.tensor(list(prompt)))
    out: list[int] = []
    while len(out) < n:
        eng.advance(st, eng.n_layers)
        m = len(prompt) + len(out)
        row = eng.logits(st, eng.n_layers, m - 1, m)[0]
        if constraint is not None:
            row = row.masked_fill(~constraint.allowed(out, len(out)), float("-inf"))
        out.append(int(row.argmax()))
        if out[-1] in eos:
            break
        eng.append(st, torch.tensor([out[-1]]))
    return out


def steps_pass_and_reference(eng, ref, prompt: torch.Tensor, ids: torch.Tensor, max_len: int,
                             boundaries=()) -> tuple:
    """Three states after ``prompt``: ``ids`` appended to one through ``eng``'s decode steps, to one in one verify
    pass of ``eng``, and to one in one pass of the engine ``ref`` (the states keep residuals at ``boundaries``)."""
    L = eng.n_layers
    steps, one, other = (e.new_state(max_len, save_boundaries=boundaries) for e in (eng, eng, ref))
    for e, st in ((eng, steps), (eng, one), (ref, other)):
        e.append(st, prompt)
        e.advance(st, L)
    for t in ids:
        eng.append(steps, t.reshape(1))
        eng.advance(steps, L)
    for e, st in ((eng, one), (ref, other)):
        e.append(st, ids)
        e.advance(st, L)
    return steps, one, other


def word_tokenizer(n_words: int = 60, chat_template: str | None = None):
    """A WordLevel tokenizer ``<pad> <s> </s> <unk> w0 .. w{n-1}`` (whitespace-split), with ``chat_template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(n_words)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def save_tiny(path: Path, seed: int = 0, n_words: int = 60, layers: int = 4, chat_template: str | None = None) -> Path:
    """A tiny Llama + a WordLevel tokenizer (``<pad> <s> </s> <unk> w0 .. w{n-1}``, with ``chat_template`` if
    given) saved as a model directory."""
    fast = word_tokenizer(n_words, chat_template)
    model = make_tiny_llama(seed=seed, vocab_size=len(fast), layers=layers, scale=8.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


def i16_reference(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, q16: int) -> torch.Tensor:
    """The kernels' int16 read of int8 ``codes`` ``[V, K]`` (row ``scale`` ``[V]``) at ``x`` ``[m, K]`` computed
    here: int64 sums of the codes and nearbyint(x / s), s = max|x| / q16 per position, then float32(sum) * (row
    scale * s) in float32."""
    s = (x.abs().amax(1) / q16).float()
    xq = torch.round(x / s[:, None]).long()
    assert xq.abs().max() <= q16
    return (xq @ codes.long().T).float() * (scale[None] * s[:, None])


def make_tiny_qwen2_family(seed: int = 0, vocab_size: int = 64, layers: int = 4, hidden: int = 64, heads: int = 4,
                           kv_heads: int = 2, tied: bool = True):
    """A randomly initialised ``Qwen2ForCausalLM`` (float32, CPU, eval; q/k/v biases drawn non-zero) whose widths
    suit the int4 kernels (multiples of 32): a tiny member of a model family."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, tie_word_embeddings=tied, use_sliding_window=False,
                      rope_theta=1e6, rms_norm_eps=1e-6, initializer_range=0.16, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


#: The chat template of :func:`qwen2_tokenizer` (Qwen's turn markers).
QWEN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen2_tokenizer():
    """A tiny tokenizer of the Qwen2 kind (the class ``transformers`` loads for a Qwen2 model directory): byte-level
    BPE without merges over the printable ASCII characters, so every character is a token (``w12`` is three),
    with Qwen's special tokens ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, the EOS)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in ["\u0120", "\u010a", "\u0109"] + [chr(c) for c in range(33, 127)]:   # space, newline, tab
        vocab[ch] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def save_tiny_family(root: Path) -> tuple[Path, Path]:
    """``(big, small)``: two tiny Qwen2 models of one tokenizer (:func:`qwen2_tokenizer`) saved as model
    directories, the way a model family shares one (a 4-layer "big" target and a 2-layer "small" draft model).
    The small one is the big one's first layers plus noise, so that its drafts are right now and then."""
    tok = qwen2_tokenizer()
    big = make_tiny_qwen2_family(seed=0, vocab_size=128, layers=4, hidden=64)
    small = make_tiny_qwen2_family(seed=1, vocab_size=128, layers=2, hidden=64)
    with torch.no_grad():        # the big one's first layers plus noise: its drafts are right now and then
        for name, p in small.named_parameters():
            p.copy_(dict(big.named_parameters())[name] + 0.02 * torch.randn_like(p))
    out = []
    for name, model in (("big", big), ("small", small)):
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path))
        tok.save_pretrained(str(path))
        out.append(path)
    return out[0], out[1]


def write_prompts(path: Path, n: int = 5, seed: int = 0) -> Path:
    """``n`` prompts of random words ``w0 .. w11`` (tasks code, math, chat in turn) as a JSON-lines file."""
    rng = np.random.default_rng(seed)
    tasks = ["code", "math", "chat"]
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in rng.integers(0, 12, size=int(rng.integers(4, 12))))
            f.write(json.dumps({"prompt": words, "task": tasks[i % 3]}) + "\n")
    return path


def write_plan(path: Path, model_dir, hierarchy=("layer1", "layer2", "layer4"), budgets=(2, 3), models=None,
               **prov) -> Path:
    """An ``hsd-plan/1`` file for a 4-layer tiny model in ``model_dir`` (exits ``layer1``, ``layer2``, the
    target ``layer4`` and an ``ngram`` drafter unless ``models`` says otherwise); ``prov`` overrides provenance
    fields."""
    models = models or [{"name": "layer1", "kind": "early_exit", "layer": 1},
                        {"name": "layer2", "kind": "early_exit", "layer": 2},
                        {"name": "ngram", "kind": "ngram_context", "config": {"q": 2, "w": 4}},
                        {"name": "layer4", "kind": "target", "layer": 4}]
    target = hierarchy[-1]                 # the baselines run the plan's target, as a solved plan's do
    baselines = {"target_only": {"hierarchy": [target], "budgets": [], "expected_latency": 0.015}}
    if target == "layer4":
        baselines["best_single_draft"] = {"hierarchy": ["layer2", "layer4"], "budgets": [3],
                                          "expected_latency": 0.012, "expected_speedup": 1.25}
    d = {"format": "hsd-plan/1", "tmax": 8, "hierarchy": list(hierarchy), "budgets": list(budgets),
         "expected_latency": 0.01, "expected_speedup": 1.5, "baselines": baselines,
         "models": models,
         "provenance": {"model": str(model_dir), "revision": None, "heads": None, "device": "cpu",
                        "dtype": "float32", **prov}}
    path.write_text(json.dumps(d))
    return path


# ------------------------------------------------------------------------------------------------ the CLI


def run_cli(*args):
    """Invoke ``hsd`` in-process with ``args`` (converted to strings); returns click's ``Result``."""
    from hsd_opt.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def cli_output(res) -> str:
    """stdout and stderr of a :func:`run_cli` result together, each once (click >= 8.2 already interleaves
    stderr into ``output``; older versions keep it apart)."""
    try:
        err = res.stderr
    except ValueError:  # stderr not captured separately
        err = ""
    return res.output if err in res.output else res.output + err


# ------------------------------------------------------------------------------------------------ token drafters


class CycleDrafter(TokenDrafter):
    """A deterministic token drafter: proposes ``(last + k * step) % V`` continuations and sometimes copies the
    token that followed the last token earlier in the context (so it is right now and then)."""

    name, kind, can_verify = "cycle", "test", False

    def __init__(self, vocab: int, step: int = 7):
        self.vocab, self.step, self.observed = vocab, step, 0

    def reset(self, prompt_ids):
        self.observed = 0

    def propose(self, context, n):
        ctx = list(context)
        out = []
        for _ in range(n):
            last = ctx[-1]
            nxt = None
            for i in range(len(ctx) - 2, -1, -1):
                if ctx[i] == last:
                    nxt = ctx[i + 1]
                    break
            if nxt is None:
                nxt = (last + self.step) % self.vocab
            out.append(nxt)
            ctx.append(nxt)
        return out

    def observe(self, context, accepted):
        self.observed += len(accepted)


class AbstainingCycleDrafter(CycleDrafter):
    """:class:`CycleDrafter` that may abstain: by context length mod 3 it proposes nothing, half a block or a
    whole block (deterministic, so the draft distribution stays one-hot)."""

    name, may_abstain = "abstaining", True

    def propose(self, context, n):
        keep = (0, n, max(1, n // 2))[len(context) % 3]
        return super().propose(context, n)[:keep]


# ------------------------------------------------------------------------------------------------ solver instances


def chi_square_pvalue(samples, probs: dict) -> float:
    """Chi-square p-value of ``samples`` (hashable outcomes) against the exact distribution ``probs`` (outcome ->
    probability): the outcomes expected 5 times or more each a cell (the test's validity), the rest one cell."""
    from scipy.stats import chisquare

    n = len(samples)
    cnt: dict = {}
    for x in samples:
        cnt[x] = cnt.get(x, 0) + 1
    big = [k for k in sorted(probs, key=probs.get, reverse=True) if probs[k] * n >= 5]
    obs, exp = [cnt.get(k, 0) for k in big], [probs[k] * n for k in big]
    if n - sum(exp) > 1e-6:
        obs.append(n - sum(obs))
        exp.append(n - sum(exp))
    return chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue


def random_profile(rng: np.random.Generator, n_drafters: int, *, non_verifying: bool = False,
                   verify_cost: bool = False, cost_curve: bool = False, missing: float = 0.2,
                   abstaining: bool = False, contexts: bool = False, growing: bool = False) -> Profile:
    """A target ``t`` (cost 1.0) and ``n_drafters`` drafters ``d0..`` with random costs (seconds),
    acceptances (some pairs missing), optionally drafters that cannot verify (``abstaining``: most of those
    get a ``draft_rate`` below 1, half of those shares of rounds per budget too), pair verify costs (scalars or
    curves) and cost curves. Models are listed in random order (the solver sorts by cost itself). ``contexts``:
    also ``context_costs`` at 2..4 random context lengths for most models and for the curves and pair costs
    (:func:`random_context_costs`)."""
    costs = rng.uniform(0.005, 0.9, n_drafters)
    names = [f"d{i}" for i in range(n_drafters)]
    models = [{"name": n, "kind": "model", "cost": float(c),
               "can_verify": bool(not (non_verifying or abstaining) or rng.random() > 0.4)}
              for n, c in zip(names, costs)]
    if abstaining:
        for m in models:
            if not m["can_verify"] and rng.random() < 0.8:
                m["draft_rate"] = float(rng.uniform(0.05, 0.95))
                sub = np.random.default_rng(int(m["cost"] * 1e9))   # apart: the instances drawn before stay
                if sub.random() < 0.5:      # shares of rounds per budget, falling with it, some budgets only
                    n = int(sub.integers(1, 7))
                    m["draft_rate_by_budget"] = sorted(sub.uniform(0.02, m["draft_rate"], n).tolist(), reverse=True)
    models.append({"name": "t", "kind": "target", "cost": 1.0, "can_verify": True})
    rng.shuffle(models)
    allc = {m["name"]: m["cost"] for m in models}
    acc: dict = {}
    for lo in names:
        for hi in names + ["t"]:
            if lo == hi or allc[lo] >= allc[hi]:
                continue
            if hi != "t" and rng.random() < missing:
                continue
            if hi == "t" and rng.random() < missing / 2:
                continue
            base = 0.25 + 0.7 * (allc[lo] / allc[hi]) ** 0.3
            acc.setdefault(lo, {})[hi] = float(np.clip(base + rng.normal(0, 0.1), 0.0, 1.0))
    d = {"format": "hsd-profile/1", "target": "t", "models": models, "acceptance": acc}
    if verify_cost:
        vc: dict = {}
        for lo, row in acc.items():
            for hi in row:
                if rng.random() < 0.5:
                    if rng.random() < 0.5:
                        vc.setdefault(hi, {})[lo] = float(allc[hi] * rng.uniform(0.3, 1.2))
                    else:
                        n = int(rng.integers(1, 5))
                        vc.setdefault(hi, {})[lo] = [float(allc[hi] * (1 + 0.1 * k) * rng.uniform(0.5, 1.0))
                                                     for k in range(n)]
        d["verify_cost"] = vc
    if cost_curve:
        cc = {}
        for n in names + ["t"]:
            if rng.random() < 0.6:
                L = int(rng.integers(1, 6))
                cc[n] = [float(allc[n] * (1 + rng.uniform(0, 0.15) * k)) for k in range(L)]
        d["cost_curve"] = cc
    if contexts:
        d["context_costs"] = random_context_costs(rng, d, growing)
    return profile_from_dict(d, "<random>")[0]


def random_context_costs(rng: np.random.Generator, d: dict, growing: bool = False) -> list[dict]:
    """``context_costs`` for the profile dict ``d``: 2..4 increasing contexts; most models (always the target),
    every cost curve and every pair verify cost get a value at each, the top-level figure times a factor per
    context. The factors are random (a model may get cheaper at a longer context, and the cost order change);
    ``growing``: non-decreasing in the context, as the profiler writes them."""
    n = int(rng.integers(2, 5))
    ctxs = sorted(int(x) for x in rng.choice(np.arange(1, 4000), size=n, replace=False))
    names = [m["name"] for m in d["models"] if m["name"] == "t" or rng.random() < 0.8]

    def factors():
        f = rng.uniform(0.5, 2.0, n)
        return np.sort(f) if growing else f

    fc = {m: factors() for m in names}
    fcc = {m: factors() for m in d.get("cost_curve", {})}
    fvc = {(v, k): factors() for v, row in d.get("verify_cost", {}).items() for k in row}
    cost = {m["name"]: m["cost"] for m in d["models"]}
    out = []
    for i, c in enumerate(ctxs):
        e = {"context": c, "cost": {m: float(cost[m] * fc[m][i]) for m in names}}
        if fcc:
            e["cost_curve"] = {m: [float(x * fcc[m][i]) for x in d["cost_curve"][m]] for m in fcc}
        if fvc:
            vc: dict = {}
            for (v, k), f in fvc.items():
                x = d["verify_cost"][v][k]
                vc.setdefault(v, {})[k] = [float(y * f[i]) for y in x] if isinstance(x, list) else float(x * f[i])
            e["verify_cost"] = vc
        out.append(e)
    return out


@functools.cache
def compiler_has_openmp() -> bool:
    """Whether the kernels' C compiler builds with OpenMP here (``-fopenmp`` and ``omp.h``): clang without libomp,
    as on a Mac, does not, and the kernels are then built without (the tests of a build with OpenMP skip). Asked
    once per test session."""
    import subprocess
    import tempfile
    from pathlib import Path

    from hsd_opt.engine import kernels

    cc = kernels.compiler()
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "omp.c"
        src.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
        res = subprocess.run([cc, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(Path(d) / "omp.so")],
                             capture_output=True)
    return res.returncode == 0


def kernel_builds() -> dict:
    """Every build of the kernels this CPU runs, by name: each variant it can run (``hsd_opt.engine.variants``,
    widest first, ``portable`` last), and ``<the widest>-no-openmp``, that variant without OpenMP (what Apple's clang
    builds). Built once into the cache; {} where there is no C compiler."""
    import ctypes

    from hsd_opt.engine import kernels, variants

    cc = kernels.compiler()
    if cc is None:
        return {}
    out = {}
    for v in variants.runnable(variants.cpu_features()):
        out[v.name] = kernels.load(variant=v.name)
    widest = variants.runnable(variants.cpu_features())[0]
    path = kernels.library_path(cc, widest, openmp=False)
    if not path.is_file():
        kernels.build(cc, path, widest, openmp=False)
    out[f"{widest.name}-no-openmp"] = kernels._bind(ctypes.CDLL(str(path)))
    return out


def q4_1_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Float32 weights as GGUF Q4_1 de-quantizes them: per group of 32 columns, code * d + m with codes 0..15
    (0 and 15 present), d and m in float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 3], q[..., 17] = 0, 15
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(rows, cols // 32, 1, generator=g) * 0.1).half().float()
    return (q * d + m).reshape(rows, cols)


def q8_0_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Float32 weights as GGUF Q8_0 de-quantizes them: per group of 32 columns, code * d with codes -127..127
    (127 or -127 present, as Q8_0's quantizer gives the group's largest magnitude), d in float16; one group all
    zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (rows, cols // 32, 32), generator=g).float()
    q[..., 5] = torch.where(torch.rand(rows, cols // 32, generator=g) < 0.5, 127.0, -127.0)
    q[0, 0] = 0
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 1e-3 + 1e-5).half().float()
    return (q * d).reshape(rows, cols)


class TinyTokenizer:
    """A byte tokenizer over a fixed list of token strings, for grammars over the tiny models' vocabularies: ids
    0, 1, 2 are special (padding, start, end of sequence), the others are their strings' bytes; ``encode_bytes``
    splits text by the longest token at each place (the tokenizer's canonical split)."""

    def __init__(self, strings: list[str]):
        self.tokens = [s.encode() for s in strings]
        self.special_ids = [0, 1, 2]
        self._by_bytes = {b: i for i, b in enumerate(self.tokens) if i not in self.special_ids}
        self._longest = max(len(b) for b in self._by_bytes)

    def encode_bytes(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._by_bytes.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"no token for {data[i:i + 1]!r}")
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode())

    def decode(self, ids) -> str:
        return b"".join(self.tokens[i] for i in ids if i not in self.special_ids).decode()


#: 64 token strings for JSON over a 64-token tiny model: the special three, JSON's punctuation, digits, letters and
#: a few longer pieces.
JSON_TOKENS = (["<pad>", "<s>", "</s>"] + list('{}[]":, ') + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz")
               + ['{"', '":', '", ', ', "', '": ', "true", "false", "null", "ab", "cd", "ef", "gh", "ij", '":"',
                  '","', '"}', "10"])


def four_hierarchies(lm, vocab: int) -> list[tuple[list, list[int]]]:
    """``(levels, budgets)`` of four hierarchies over the target ``lm`` (``vocab`` its width): the target alone,
    an exit under it, a token drafter under an exit under it (depth 3), and a drafter that abstains at times."""
    from hsd_opt.runtime.decode import Level

    L = lm.n_layers
    return [
        ([Level("target", lm, L)], []),
        ([Level("layer2", lm, 2), Level("target", lm, L)], [3]),
        ([Level("cycle", drafter=CycleDrafter(vocab)), Level("layer3", lm, 3), Level("target", lm, L)], [2, 4]),
        ([Level("abstaining", drafter=AbstainingCycleDrafter(vocab)), Level("target", lm, L)], [5]),
    ]


def timing_calls(contexts, n_boundaries: int, tmax: int = 15, repeats: int = 5, warmup: int = 2,
                 curve_repeats: int = 3, shared: bool = False, plan=None, chunk: int | None = None) -> int:
    """How many times ``measure_costs`` calls ``on_step`` with these settings before any refinement, counted from
    the passes ``plan_passes`` lists: one per prefill chunk of the longest context (``shared``: one per context,
    the prompt taken from another engine's states), one per direct step check, one per timed segment and one per
    direct round of each directly timed t."""
    from hsd_opt.profiler.costs import CostPlan, plan_passes
    from hsd_opt.runtime.decode import PREFILL_CHUNK

    plan = plan or CostPlan("full", max(0, warmup), max(1, repeats), max(1, curve_repeats))
    ctxs = sorted(set(int(c) for c in contexts))
    prefill = len(ctxs) if shared else -(-ctxs[-1] // (chunk or PREFILL_CHUNK)) + len(ctxs) - 1
    n = plan_passes(plan, ctxs, n_boundaries, tmax)
    n_check = n["steps"].get(1, 0) // (plan.warmup + plan.repeats)
    return prefill + n_check + sum(n["segments"].values()) + len(n["direct"]) * plan.direct_rounds


def refinement_bound(plan, tmax: int) -> int:
    """The most ``on_step`` calls a refinement of the direct timings adds: every t off the grid, all rounds."""
    from hsd_opt.profiler.costs import t_grid

    return 0 if plan.direct_every_t else (tmax + 1 - len(t_grid(tmax + 1))) * plan.direct_rounds
