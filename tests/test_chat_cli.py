"""`hsd chat` on a tiny plan: messages read one per line, each answer the plan's answer to the whole conversation
computed afresh (greedy and seeded sampling), later turns computing only their new tokens, /reset starting over,
and bad flags or input refused with one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hsd_opt.cli import app
from hsd_opt.formats import load_plan
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import chat_ids
from hsd_opt.runtime.runner import hsd_for_plan
from hsd_opt.seeds import SEED_RANGE, offset_seed
from tests.helpers import TINY_CHAT_TEMPLATE, save_tiny, write_plan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model_dir = save_tiny(root / "m", chat_template=TINY_CHAT_TEMPLATE)
    plan = write_plan(root / "plan.json", model_dir, hierarchy=("ngram", "layer2", "layer4"), budgets=(1, 2))
    return plan, model_dir


def _chat(plan, lines: list[str], *flags):
    res = CliRunner().invoke(app, ["chat", "--plan", str(plan), "--device", "cpu", *map(str, flags)],
                             input="".join(line + "\n" for line in lines))
    return res


def _want(plan, model_dir, convos: list[list[str]], n: int, system: str | None = None, **kw) -> str:
    """stdout a fresh runner gives: each conversation's turns answered in order (turn k seeded seed + k)."""
    loaded = load_model(str(model_dir), device="cpu")
    runner = hsd_for_plan(load_plan(plan), loaded)
    tok, out, turn = loaded.tokenizer, [], 0
    seed = kw.pop("seed", 0)
    for lines in convos:
        msgs = [{"role": "system", "content": system}] if system else []
        for text in lines:
            msgs.append({"role": "user", "content": text})
            ids = runner.generate(chat_ids(tok, msgs), n, seed=offset_seed(seed, turn), **kw).token_ids
            answer = tok.decode(ids, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": answer})
            out.append(answer + "\n")
            turn += 1
    return "".join(out)


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.9", "--seed", "5"),
                                      ("--temperature", "0.9", "--seed", str(SEED_RANGE[1]))])
def test_each_answer_is_the_plans_answer_to_the_whole_conversation(tiny, sampling):
    plan, model_dir = tiny
    res = _chat(plan, ["w1 w2 w3", "w4 w5", "", "/reset", "w6 w7 w8 w9"], "--max-new-tokens", 9,
                "--system", "w30 w31", *sampling)
    assert res.exit_code == 0, res.output
    kw = {"temperature": 0.9, "seed": int(sampling[-1])} if sampling else {}   # the last seed's turns wrap
    assert res.stdout == _want(plan, model_dir, [["w1 w2 w3", "w4 w5"], ["w6 w7 w8 w9"]], 9, "w30 w31", **kw)
    computed = [int(line.split(" tokens, ")[-1].split(" computed")[0]) for line in res.stderr.splitlines()
                if line.endswith("computed]")]
    prompts = [int(line.split("prompt ")[1].split(" tokens")[0]) for line in res.stderr.splitlines()
               if line.endswith("computed]")]
    assert len(computed) == 3 and computed[1] < prompts[1] - prompts[0]      # the second turn took the first


def test_bad_flags_exit_2_with_one_line(tiny):
    plan, _ = tiny
    for flags, needle in [(("--max-new-tokens", 0), "--max-new-tokens"), (("--system", " "), "--system"),
                          (("--mode", "lazy"), "--mode"), (("--top-p", 0), "--top-p"),
                          (("--max-new-tokens", 512), "--max-new-tokens 512: the model's context is 512"),
                          # no turn could fit: every line was its own error, and the chat exited 0
                          (("--max-new-tokens", 511), "--max-new-tokens 511: a one-word message makes a prompt of"),
                          (("--system", " ".join(["w5"] * 600), "--max-new-tokens", 8),
                           "--system: a one-word message makes a prompt of")]:
        res = _chat(plan, ["w1"], *flags)
        errors = [x for x in res.output.splitlines() if x.startswith("error:")]
        assert res.exit_code == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in res.output


def test_ctrl_c_during_an_answer_drops_that_turn_and_the_chat_goes_on(tiny, monkeypatch):
    from hsd_opt.runtime.decode import HSD

    plan, model_dir = tiny
    real, calls = HSD.generate, []

    def interrupted_once(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(HSD, "generate", interrupted_once)
    res = _chat(plan, ["w1 w2 w3", "w6 w7 w8 w9"], "--max-new-tokens", 7)
    assert res.exit_code == 0, res.output
    assert "(stopped" in res.stderr
    monkeypatch.setattr(HSD, "generate", real)
    assert res.stdout == "\n" + _want(plan, model_dir, [["w6 w7 w8 w9"]], 7)


def test_a_line_that_is_not_utf8_is_dropped_with_one_line_and_the_chat_goes_on(tiny):
    """Bytes that are not UTF-8 on stdin (a traceback, or the chat template's error under another locale's
    decoding): that line is refused naming it, and the conversation goes on as without it."""
    plan, model_dir = tiny
    res = CliRunner().invoke(app, ["chat", "--plan", str(plan), "--device", "cpu", "--max-new-tokens", "6"],
                             input=b"w1 w2 w3\ncaf\xe9 \xff\nw4 w5\n")
    assert res.exit_code == 0, res.output
    assert "error: line 2 of the input is not UTF-8 text: the turn is dropped" in res.stderr
    assert res.stdout == _want(plan, model_dir, [["w1 w2 w3", "w4 w5"]], 6)


def test_a_turn_past_the_context_says_reset_starts_over(tiny):
    """A conversation that no longer fits failed every later turn the same way, the error not saying what to do;
    a message too long even alone said to /reset too, which would not help."""
    plan, _ = tiny
    res = _chat(plan, ["w1 w2", " ".join(["w3"] * 600), " ".join(["w3"] * 250), " ".join(["w4"] * 250), "/reset",
                       "w4 w5"], "--max-new-tokens", 4)
    assert res.exit_code == 0, res.output
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 2 and all("context" in e for e in err), err
    assert err[0].endswith("the message is too long even alone"), err
    assert err[1].endswith("/reset starts the conversation over"), err
    assert len(res.stdout.splitlines()) == 3                     # the first, third and last turns' answers


def test_a_system_message_the_template_refuses_is_refused_at_start(tmp_path):
    """``--system`` with a model whose chat template has no system role: one line naming the flag, exit 2,
    before the first message (every turn failed instead)."""
    refusing = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                "{% if add_generation_prompt %}<s> assistant {% endif %}")
    model_dir = save_tiny(tmp_path / "m", chat_template=refusing)
    plan = write_plan(tmp_path / "plan.json", model_dir, hierarchy=("ngram", "layer4"), budgets=(1,))
    res = _chat(plan, ["w1"], "--system", "w5")
    errors = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error: --system:"), res.output
    assert "System role not supported" in errors[0] and "ready" not in res.output


def test_no_standard_input_at_all_ends_the_chat(tiny, monkeypatch):
    """``hsd chat <&-`` (stdin closed: ``sys.stdin`` is None) ends as end of input does (it was a traceback)."""
    import sys

    from hsd_opt.commands import chat

    monkeypatch.setattr(sys, "stdin", None)
    assert list(chat._lines()) == []
