"""Structured output: grammars (JSON schemas, JSON, Lark, regular expressions) compiled for a tokenizer
(:mod:`~hsd_opt.grammar.compiler`), and one sequence's grammar state, the tokens allowed after each prefix of what it
has generated (:mod:`~hsd_opt.grammar.constraint`). The decoding masks every level's logits with it."""
