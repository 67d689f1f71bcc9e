"""Per-chunk cost of streaming a choice: incremental decoding vs decoding the whole output at each chunk.

Feeds a ``ChoiceDecoder`` (the tiny model's real tokenizer) one token per chunk, as an engine streams, for
outputs of several lengths, once as the gateway does now (``IncrementalText``) and once decoding the whole
output at every chunk (what it did before, and still does for tokenizers that clean up spaces), and
prints microseconds per chunk and token ids handed to the tokenizer per chunk. Flat with output length =
O(new tokens) per chunk.

    python bench/stream_decode.py [--lengths 250,1000,4000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.decoding import ChoiceDecoder  # noqa: E402
from gateway.engine_client import Generation  # noqa: E402

TEXT = "Héllo wörld 😀 — 日本語のテキスト, naïve café ✓ 🧪🧬 and some plain English words too. "



def run(tok: object, ids: list[int], incremental: bool) -> tuple[float, float]:
    decoder = ChoiceDecoder(tok, stop=["never appears"], stop_token_ids=[], parse_tools=False)
    if not incremental:
        decoder.text = None
    calls = {"ids": 0}
    decode = decoder.decode

    def counting(part: list[int]) -> str:
        calls["ids"] += len(part)
        return decode(part)

    decoder.decode = counting  # type: ignore[method-assign]
    if decoder.text is not None:
        decoder.text._decode = counting
    gen = Generation(output_ids=[], logprobs=[], versions=[])
    start = time.perf_counter()
    for token in ids:
        gen.output_ids.append(token)  # the router appends new tokens to the one cumulative list
        gen.logprobs.append(0.0)
        gen.versions.append(0)
        decoder.step(gen)
    elapsed = time.perf_counter() - start
    return 1e6 * elapsed / len(ids), calls["ids"] / len(ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="250,1000,4000")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from engine.models import tiny_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_dir()))
    load = os.getloadavg()[0]
    print(f"streamed decoding per chunk (one token per chunk), {os.cpu_count()} cores, load {load:.2f}")
    print(f"{'tokens':>7s} {'incremental us/chunk':>21s} {'whole us/chunk':>15s} {'ids decoded/chunk':>18s} {'(whole)':>8s}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = (tok.encode(TEXT * (1 + n // 20), add_special_tokens=False))[:n]
        inc, inc_ids = run(tok, ids, True)
        whole, whole_ids = run(tok, ids, False)
        print(f"{n:7d} {inc:21.1f} {whole:15.1f} {inc_ids:18.1f} {whole_ids:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
