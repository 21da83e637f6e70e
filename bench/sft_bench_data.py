"""The chat data of the SFT benchmark in BENCHMARKS.md ("LoRA SFT of SmolLM2-135M-Instruct"):
each of the 36 chats of examples/data/capitals.jsonl asked 10 ways, 360 single-turn chats with
the same answer format, as JSONL for `fastllm train data.path=...`.

    python bench/sft_bench_data.py OUT.jsonl
"""

import json
import os
import re
import sys

ASKED = ["What is the capital of {}?", "Name the capital city of {}.",
         "Which city is the capital of {}?", "Tell me the capital of {}.",
         "{}: which city is its capital?", "What city serves as the capital of {}?",
         "Could you tell me the capital of {}?", "I need the capital of {}.",
         "Capital of {}?", "What's the capital city of {}?"]


def chats(path):
    out = []
    with open(path) as f:
        for line in f:
            reply = json.loads(line)["messages"][-1]["content"]
            country = re.search(r"Country: ([^.]+)\.", reply).group(1)
            out += [{"messages": [{"role": "user", "content": q.format(country)},
                                  {"role": "assistant", "content": reply}]} for q in ASKED]
    return out


if __name__ == "__main__":
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "data", "capitals.jsonl")
    records = chats(src)
    with open(sys.argv[1], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"{sys.argv[1]}: {len(records)} chats")
