"""Time to the first token of short requests sent while a long prompt is computed, against a running server.

    .venv/bin/python -m benchmarks.ttft_behind_long --url http://127.0.0.1:8000 --repeats 200 --shorts 3 \\
        --out short_ttft.json

Steps: a short streamed completion alone (its time to the first token with nothing else to do); then a long one (a
fixed sentence, ``LONG_TEXT``, repeated ``--repeats`` times) and, ``--gap`` seconds after it and after each other,
``--shorts`` short ones, each in a thread; every request greedy, ``--max-tokens`` tokens, timed from its sending to
its first streamed text and to its end (seconds, on this machine's clock). Prints and writes (``--out``, atomically)
each request's figures and the long prompt's token count (the server's ``/tokenize``). Any server with the OpenAI
completions API and ``/tokenize`` (``hsd serve``; llama.cpp's ``llama-server`` answers ``/tokenize`` too). """

from __future__ import annotations

import argparse
import json
import threading
import time

from benchmarks.entry import count, run, seconds
from hsd_opt.errors import HsdError
from hsd_opt.jsonio import write_json

LONG_TEXT = "The history of the city is long and varied, with many events. "
SHORT = "Hello, my name is"


def timed_stream(url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One greedy streamed completion of ``prompt``: ``{"ttft_s", "total_s", "text"}`` (``ttft_s`` None when no text
    came); an :class:`HsdError` on an answer other than 200."""
    import httpx

    t0 = time.perf_counter()
    first, text = None, []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=timeout) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise HsdError(f"{url}: answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            piece = (json.loads(line[5:])["choices"] or [{}])[0].get("text")
            if piece:
                first = first if first is not None else time.perf_counter() - t0
                text.append(piece)
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "text": "".join(text)}


def measure(url: str, repeats: int, shorts: int, gap: float, max_tokens: int, timeout: float = 600.0,
            text: str = LONG_TEXT) -> dict:
    """The report (see the module doc)."""
    import httpx

    long_prompt = text * repeats
    try:
        # "content": llama-server's name, which hsd serve reads too ("prompt" is vLLM's, and llama-server's answer
        # to it is no tokens)
        tokens = httpx.post(f"{url}/tokenize", json={"content": long_prompt}, timeout=timeout).json()
    except httpx.HTTPError as e:                   # no server there: one line naming the flag
        raise HsdError(f"--url {url}: {type(e).__name__}: {e}") from None
    out: dict = {"url": url, "long_prompt_tokens": tokens.get("count", len(tokens.get("tokens", []))),
                 "alone": timed_stream(url, SHORT, max_tokens, timeout), "shorts": [None] * shorts}
    errors: list[BaseException] = []

    def send(prompt: str, put) -> None:
        try:
            put(timed_stream(url, prompt, max_tokens, timeout))
        except BaseException as e:  # noqa: BLE001 - said by the main thread
            errors.append(e)

    threads = [threading.Thread(target=send, args=(long_prompt, lambda r: out.__setitem__("long", r)))]
    threads += [threading.Thread(target=send, args=(f"{SHORT} {i}", lambda r, i=i: out["shorts"].__setitem__(i, r)))
                for i in range(shorts)]
    for t in threads:
        t.start()
        time.sleep(gap)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="The server's base URL (http://127.0.0.1:8000).")
    ap.add_argument("--repeats", type=count, default=200, help="Times the long prompt repeats its sentence.")
    ap.add_argument("--shorts", type=count, default=3, help="Short requests sent after the long one.")
    ap.add_argument("--gap", type=seconds, default=0.2, help="Seconds between two requests' sending.")
    ap.add_argument("--max-tokens", type=count, default=16)
    ap.add_argument("--out", help="Also write the report as JSON.")
    args = ap.parse_args()
    rep = measure(args.url.rstrip("/"), args.repeats, args.shorts, args.gap, args.max_tokens)
    for name, r in [("alone", rep["alone"]), ("long", rep["long"])] + [(f"short {i}", r)
                                                                       for i, r in enumerate(rep["shorts"])]:
        first = "no text" if r["ttft_s"] is None else f"first token {r['ttft_s']:.2f} s"
        print(f"{name}: {first}, end {r['total_s']:.2f} s")
    if args.out:
        write_json(args.out, rep)


if __name__ == "__main__":
    run(main)
