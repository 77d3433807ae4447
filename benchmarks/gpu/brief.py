"""One line per bench JSON: TTFT / TTFP / RTF p50, audio s per wall s, errors (for progress logs)."""

import json
import sys

for path in sys.argv[1:]:
    try:
        lv = json.load(open(path))["levels"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"{path}: {type(e).__name__}", end="; ")
        continue
    g = lambda k: (lv.get(k) or {}).get("p50")  # noqa: E731
    print(f"c={lv['concurrency']} ttft {g('ttft_ms')} ms, ttfp {g('ttfp_ms')} ms, last packet {g('last_packet_ms')} ms, rtf {g('rtf')}, "
          f"audio/wall {lv.get('audio_s_per_wall_s')}, stall p90 {(lv.get('stall_ms') or {}).get('p90')} ms, tok/s {lv.get('output_tok_s')}, errors {lv['errors']} "
          f"{lv.get('error_examples') or ''}", end="")
    if lv.get("prompt_tokens"):
        print(f", prompt tokens {lv['prompt_tokens']} ({lv.get('cached_tokens')} cached)", end="")
    firsts = [s.get("first_output_ms") for s in lv.get("stages") or []]
    print(f", stages' first output {firsts} ms" if any(f is not None for f in firsts) else "", end="; ")
print()
