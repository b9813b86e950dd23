"""A converted model's tokenizer read with ``tokenizers`` alone (:class:`~hsd_opt.models.tokenizer.DirectTokenizer`)
is transformers' tokenizer of the same directory: the same Rust tokenizer (serialized forms equal), the same ids for
texts and chats, the same text for ids, the same special tokens; what it does not answer itself transformers does;
and loading the embedded model and decoding a prompt then never imports transformers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hsd_opt.models.loading import load_tokenizer, transformers_tokenizer
from hsd_opt.models.tokenizer import DirectTokenizer
from hsd_opt.prompts import chat_ids, encode_prompt, template_head
from tests.helpers import qwen2_tokenizer, write_plan

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["Write a haiku about the sea.", "e\u0301 caf\u00e9 \u00c5 \u212b (not NFC)", "<|im_start|>user\nhi<|im_end|>",
         "  leading and trailing  ", "\t\ttabs\n\n\nnewlines", "emoji \U0001F600\U0001F44D\U0001F3FD, \u4e2d\u6587, "
         "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", '<tool_call>{"a": 1}</tool_call>', " ", "x<|endoftext|>y",
         "def f(x):\n    return x ** 2  # square\n"]
CHATS = [[{"role": "user", "content": t}] for t in TEXTS[:4]] + [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}]]


def _chat_list(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def assert_same_tokenizer(direct: DirectTokenizer, hf) -> None:
    """Every answer the runtime, the server and the grammar compiler ask of a tokenizer, compared."""
    assert direct.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert direct.special_tokens_map == hf.special_tokens_map and direct.chat_template == hf.chat_template
    assert (len(direct), direct.vocab_size) == (len(hf), hf.vocab_size)
    assert (direct.eos_token_id, direct.bos_token_id, direct.pad_token_id) == \
        (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
    assert direct.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    assert direct.get_vocab() == hf.get_vocab()
    for text in TEXTS:
        assert direct(text)["input_ids"] == hf(text)["input_ids"], text
        assert direct.encode(text) == hf.encode(text)
        assert direct.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        if text.strip():
            assert encode_prompt(direct, text) == encode_prompt(hf, text)
    for chat in CHATS:
        for gen in (True, False):
            assert direct.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert _chat_list(direct.apply_chat_template(chat, add_generation_prompt=gen)) == \
                _chat_list(hf.apply_chat_template(chat, add_generation_prompt=gen))
        assert chat_ids(direct, chat) == chat_ids(hf, chat)
    assert template_head(direct) == template_head(hf)
    rng = random.Random(0)
    specials = sorted(hf.added_tokens_decoder)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) if rng.random() < 0.8 else rng.choice(specials)
               for _ in range(rng.randrange(1, 16))]
        for skip in (False, True):
            assert direct.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
        assert direct.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert direct.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])


def test_the_embedded_models_tokenizer_is_read_directly_and_is_transformers(embedded):
    assert isinstance(embedded.tokenizer, DirectTokenizer)
    hf = transformers_tokenizer(str(embedded.tokenizer.path), "embedded")
    assert not isinstance(hf, DirectTokenizer)
    assert_same_tokenizer(embedded.tokenizer, hf)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A converted directory of a Qwen2 tokenizer (the class normalizes to NFC where its tokenizer.json does not)."""
    path = tmp_path_factory.mktemp("qwen2tok")
    qwen2_tokenizer().save_pretrained(str(path))
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    return path


def test_a_qwen2_directory_is_read_as_transformers_reads_it(qwen_dir):
    direct = load_tokenizer(str(qwen_dir), "gguf")
    assert isinstance(direct, DirectTokenizer)
    assert direct.backend_tokenizer.normalizer is not None
    assert_same_tokenizer(direct, transformers_tokenizer(str(qwen_dir), "gguf"))


def test_what_it_does_not_answer_transformers_does(qwen_dir):
    direct = load_tokenizer(str(qwen_dir), "gguf")
    hf = transformers_tokenizer(str(qwen_dir), "gguf")
    assert direct._hf is None
    assert direct.all_special_ids == hf.all_special_ids            # an attribute of transformers' alone
    assert direct._hf is not None
    # a message with another field, a call with other arguments: transformers' answers
    named = [{"role": "user", "content": "w1", "name": "x"}]
    assert _chat_list(direct.apply_chat_template(named, add_generation_prompt=True)) == \
        _chat_list(hf.apply_chat_template(named, add_generation_prompt=True))
    assert direct("w1 w2", return_tensors="pt")["input_ids"].tolist() == \
        hf("w1 w2", return_tensors="pt")["input_ids"].tolist()
    with pytest.raises(AttributeError):
        direct._no_such_private_name


def test_a_template_that_refuses_a_chat_says_why_as_transformers_does(qwen_dir, tmp_path):
    d = tmp_path / "refusing"
    shutil.copytree(qwen_dir, d)
    (d / "chat_template.jinja").write_text("{% if messages[0]['role'] != 'user' %}"
                                           "{{ raise_exception('the first turn must be the user') }}{% endif %}"
                                           "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    direct = load_tokenizer(str(d), "gguf")
    assert isinstance(direct, DirectTokenizer)
    from hsd_opt.errors import HsdError

    with pytest.raises(HsdError, match="the first turn must be the user"):
        chat_ids(direct, [{"role": "assistant", "content": "w1"}])
    assert chat_ids(direct, [{"role": "user", "content": "w1"}]) == \
        chat_ids(transformers_tokenizer(str(d), "gguf"), [{"role": "user", "content": "w1"}])


def test_directories_it_does_not_read_go_to_transformers(qwen_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(qwen_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert DirectTokenizer.open(other, lambda: None) is None
    assert not isinstance(load_tokenizer(str(other), "gguf"), DirectTokenizer)
    assert not isinstance(load_tokenizer(str(qwen_dir), "local"), DirectTokenizer)    # not a directory of ours
    asks_cleanup = tmp_path / "cleanup"
    shutil.copytree(qwen_dir, asks_cleanup)
    (asks_cleanup / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    assert DirectTokenizer.open(asks_cleanup, lambda: None) is None


def test_structured_output_reads_the_same_tokens_from_either(qwen_dir):
    pytest.importorskip("llguidance")
    from hsd_opt.grammar.compiler import _ll_tokenizer

    direct = load_tokenizer(str(qwen_dir), "gguf")
    a, b = _ll_tokenizer(direct, [2]), _ll_tokenizer(transformers_tokenizer(str(qwen_dir), "gguf"), [2])
    assert direct._hf is None                      # read without transformers
    assert a.vocab_size == b.vocab_size
    for text in TEXTS:
        assert a.tokenize_str(text) == b.tokenize_str(text)
    for i in range(a.vocab_size):
        assert a.decode_bytes([i]) == b.decode_bytes([i])


def test_hsd_run_on_the_embedded_model_imports_no_transformers(embedded, tmp_path):
    """``hsd run`` with a plan of the embedded model (lookup over the target), in a fresh interpreter: the answer
    is the target's greedy text (the same as through transformers' tokenizer), and transformers is never
    imported (about a second of start-up)."""
    plan = write_plan(tmp_path / "plan.json", "embedded:smollm2-135m", hierarchy=("lookup", "layer30"), budgets=(2,),
                      models=[{"name": "lookup", "kind": "ngram_context",
                               "config": {"q": 3, "w": 4, "min_q": 2, "abstain": True}},
                              {"name": "layer30", "kind": "target", "layer": 30}],
                      revision=embedded.revision)
    rep = tmp_path / "run.json"
    argv = ["hsd", "run", "--plan", str(plan), "--prompt", "Say hi.", "--max-new-tokens", "6", "--json", str(rep)]
    code = ("import sys\n"
            "from hsd_opt.cli import main\n"
            f"sys.argv = {argv!r}\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(rep.read_text().splitlines()[0])
    hf = transformers_tokenizer(str(embedded.tokenizer.path), "embedded")
    ids = encode_prompt(hf, "Say hi.")
    assert got["stats"]["prefill_tokens"] == len(ids)
    import torch

    want = embedded.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert got["token_ids"] == want
    assert got["text"] == hf.decode(want, skip_special_tokens=True)


def test_the_eos_ids_are_the_files_and_the_special_tokens_that_end_a_text(embedded):
    """Qwen2.5's GGUF names ``<|im_end|>`` as EOS alone, and its ``<|endoftext|>`` went on into a made-up next turn
    (llama.cpp ends there, as Qwen's own generation config does): the tokenizer's special tokens of llama.cpp's
    end-of-generation texts are EOS ids too, its fill-in-the-middle pad, repository and file separator tokens
    included (llama.cpp ends there as well); an ordinary token of such a text (Qwen's ``</s>``) is not."""
    from types import SimpleNamespace

    from hsd_opt.models.loading import eos_token_ids

    # SmolLM2: <|im_end|> named, <|endoftext|> special, and <reponame> (4), which llama.cpp takes as its
    # fill-in-the-middle repository token and so as an end of generation
    assert eos_token_ids(embedded) == [0, 2, 4]
    qwen = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(eos_token_id=2)), tokenizer=qwen2_tokenizer())
    assert eos_token_ids(qwen) == [0, 2]
    coder = qwen2_tokenizer()       # Qwen2.5-Coder's fill-in-the-middle tokens: llama.cpp ends at pad, repo, file_sep
    coder.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>",
                                                            "<|file_sep|>"]})
    fim = [coder.convert_tokens_to_ids(t) for t in ("<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
    assert eos_token_ids(SimpleNamespace(model=qwen.model, tokenizer=coder)) == [0, 2] + fim[1:]

    class Plain:            # "</s>" a token of the vocabulary, as text: kept by a decode that skips special tokens
        eos_token_id = 5

        def encode(self, text, add_special_tokens=False):
            return [9] if text == "</s>" else [1, 2]

        def decode(self, ids, skip_special_tokens=False):
            return "</s>" if list(ids) == [9] else "?"

    plain = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(eos_token_id=None)), tokenizer=Plain())
    assert eos_token_ids(plain) == [5]
