"""transformers as the external oracle of troupe's model families (kernels/model/tests/hf_transformers.rs).

    oracle.py make OUT            random tiny models saved with save_pretrained, and what transformers
                                  computes on fixed tokens: logits, loss and every parameter's gradient
    oracle.py check DIR TOKENS    loads DIR with from_pretrained (no missing, unexpected or mismatched
                                  keys, no warning) and prints the loss on TOKENS (a safetensors file) as JSON
    oracle.py generate DIR TOKENS N   greedy generate(do_sample=False) of N new tokens after TOKENS

Pinned by scripts/provision-libtorch.sh: torch 2.11.0, transformers 5.24.0.
"""
import json
import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import transformers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

torch.set_num_threads(1)

BATCH, TIME = 2, 17  # TIME - 1 positions are fed, the next token of each is the target


def models():
    """The shapes the oracle covers: GQA, tied and untied heads, rope_theta != 10000, Llama 3's rope
    scaling, Qwen2's q/k/v biases, GPT-2 with gelu_new and a tied head, and with exact gelu untied."""
    llama = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                 rms_norm_eps=1e-5, initializer_range=0.2)
    return {
        "llama_gqa": LlamaConfig(**llama, rope_theta=500000.0, tie_word_embeddings=False),
        "llama_tied_rope3": LlamaConfig(**llama, rope_theta=10000.0, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8}),
        "llama_mha_head_dim": LlamaConfig(**{**llama, "num_key_value_heads": 4}, head_dim=32,
                                          tie_word_embeddings=False),
        "qwen2": Qwen2Config(**llama, rope_theta=1000000.0, tie_word_embeddings=False),
        "gpt2_tied": GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                activation_function="gelu_new", initializer_range=0.2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "gpt2_untied": GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=96,
                                  activation_function="gelu", initializer_range=0.2, tie_word_embeddings=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }


def loss_of(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return logits, loss


def make(out):
    for i, (name, config) in enumerate(models().items()):
        torch.manual_seed(1000 + i)
        config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "gpt2": "GPT2LMHeadModel"}[config.model_type]]
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
        with torch.no_grad():  # norms and biases away from their 1/0 initialisation, so a misuse shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        model.eval()
        directory = os.path.join(out, name)
        model.save_pretrained(directory)
        tokens = torch.randint(0, config.vocab_size, (BATCH, TIME), generator=torch.Generator().manual_seed(i))
        logits, loss = loss_of(model, tokens)
        # transformers' own shifted loss must be the same number (checks the oracle's loss itself).
        own = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        plain = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:-1].reshape(-1))
        assert torch.allclose(own, plain, rtol=1e-6), (own, plain)
        loss.backward()
        grads = {n: p.grad.detach().contiguous() for n, p in model.named_parameters()}
        os.makedirs(os.path.join(directory, "grads"), exist_ok=True)
        save_file(grads, os.path.join(directory, "grads", "model.safetensors"))
        with open(os.path.join(directory, "grads", "config.json"), "w") as f:
            f.write(config.to_json_string())
        save_file({"tokens": tokens, "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)},
                  os.path.join(directory, "oracle.safetensors"))
    print(json.dumps({"models": list(models()), "transformers": transformers.__version__}))


def load_quietly(directory):
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                           attn_implementation="eager")
    logger.removeHandler(handler)
    caught += [str(x.message) for x in w]
    return model.float().eval(), info, caught


def check(directory, tokens_file):
    model, info, caught = load_quietly(directory)
    tokens = load_file(tokens_file)["tokens"]
    with torch.no_grad():
        _, loss = loss_of(model, tokens)
    print(json.dumps({"loss": loss.item(), "missing": sorted(info.get("missing_keys", [])),
                      "unexpected": sorted(info.get("unexpected_keys", [])),
                      "mismatched": sorted(str(m) for m in info.get("mismatched_keys", [])),
                      "warnings": caught, "dtype": str(next(model.parameters()).dtype)}))


def generate(directory, tokens_file, new_tokens):
    model, _, _ = load_quietly(directory)
    tokens = load_file(tokens_file)["tokens"]
    out = model.generate(tokens, max_new_tokens=int(new_tokens), do_sample=False, min_new_tokens=int(new_tokens),
                         pad_token_id=0, eos_token_id=None)
    print(json.dumps({"tokens": out[0].tolist()}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"make": make, "check": check, "generate": generate}[command](*args)
