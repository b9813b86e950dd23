"""Check on a fetched model of the Qwen2.5-Coder family: our autoregressive loop (HSD with the target alone, over
the layered engine) gives the same greedy tokens as Hugging Face ``generate``.

    hsd models fetch qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/family_greedy_check.py [--model qwen2.5-coder-0.5b] [--max-new-tokens 16]

Prints both token lists, the decoded text and the wall time of each; exits 1 when they differ. (A script, not a
test: it needs the fetched model.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main() -> int:
    import torch

    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.models.loading import eos_token_ids, load_model
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.decode import HSD, Level

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    t0 = time.perf_counter()
    loaded = load_model(args.model, device="cpu", dtype="float32")
    print(f"loaded {loaded.model_id} ({loaded.model.config.model_type}, {loaded.model.config.num_hidden_layers} "
          f"layers, tied head: {loaded.model.config.tie_word_embeddings}) in {time.perf_counter() - t0:.1f} s")
    ids = encode_prompt(loaded.tokenizer, args.prompt)
    eos = eos_token_ids(loaded)

    t0 = time.perf_counter()
    inp = torch.tensor([ids])
    out = loaded.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=args.max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos[0], temperature=None,
                                top_p=None, top_k=None)
    hf = out[0, len(ids):].tolist()
    t_hf = time.perf_counter() - t0

    lm = LayeredLM(loaded.model)
    t0 = time.perf_counter()
    res = HSD([Level("target", lm, lm.n_layers)], [], eos_ids=eos).generate(ids, args.max_new_tokens)
    t_ar = time.perf_counter() - t0

    print(f"prompt: {len(ids)} tokens; on the kernels: {lm.uses_kernels}")
    print(f"hf generate ({t_hf:.2f} s): {hf}")
    print(f"our AR      ({t_ar:.2f} s): {res.token_ids}")
    print("text:", repr(loaded.tokenizer.decode(res.token_ids)))
    same = hf == res.token_ids
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
