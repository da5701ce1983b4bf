#!/usr/bin/env python3
"""The transformers peer of `troupe bench generate`: greedy decoding of the same Hugging Face directory
with transformers' generate (do_sample=False, its key/value cache, SDPA attention, fp32), printing one
JSON object with the new tokens per second of each timed run (prompt included in the time, as troupe's)
and the tokens of the last.
"""
import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split(",")]])

    def run(new_tokens):
        with torch.inference_mode():
            return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  use_cache=True, pad_token_id=0, eos_token_id=None)

    run(min(8, args.new_tokens))  # warm-up
    rates, out = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = run(args.new_tokens)
        rates.append(args.new_tokens / (time.perf_counter() - start))
    print(json.dumps({"peer": "transformers-generate", "tokens_per_s_runs": rates,
                      "tokens_per_s": sorted(rates)[len(rates) // 2],
                      "tokens": out[0, prompt.shape[1]:].tolist(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
