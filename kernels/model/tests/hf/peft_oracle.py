"""Hugging Face PEFT as the external oracle of troupe's LoRA (kernels/model/tests/peft_hf.rs).

    peft_oracle.py check BASE ADAPTERS TOKENS GRADS   loads BASE with transformers and ADAPTERS with
        peft.PeftModel.from_pretrained (trainable), prints the loss on TOKENS (a safetensors file), the
        number of LoRA tensors loaded and any warning as JSON, and saves every trainable tensor's gradient
        into GRADS under PEFT's file keys (adapter name left out, as save_pretrained writes them)
    peft_oracle.py make BASE OUT TOKENS R ALPHA TARGETS [MODULES_TO_SAVE]   adapters made by PEFT:
        get_peft_model(BASE, LoraConfig(...)) with A and B randomised (B is zero at PEFT's init, which
        would hide a misread B), saved with save_pretrained into OUT; prints PEFT's loss on TOKENS.
        TARGETS and MODULES_TO_SAVE are comma-separated.

Pinned by scripts/provision-libtorch.sh: torch 2.11.0, transformers 5.24.0, peft 0.21.2.
"""
import json
import logging
import sys
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import peft
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)


def loss_of(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def base_model(directory):
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()


def file_key(name):
    """A parameter's name in a PeftModel as save_pretrained writes it: without the adapter name."""
    return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def check(base_dir, adapters, tokens_file, grads_file):
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    for name in ("transformers", "peft"):
        logging.getLogger(name).addHandler(handler)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base_model(base_dir), adapters, is_trainable=True)
    caught += [str(x.message) for x in w if "deprecated" not in str(x.message)]
    model.eval()  # no dropout: troupe's evaluation forward
    tokens = load_file(tokens_file)["tokens"]
    loss = loss_of(model, tokens)
    loss.backward()
    grads = {file_key(n): p.grad.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(grads, grads_file)
    lora = sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
    print(json.dumps({"loss": loss.item(), "lora_tensors": lora, "trainable": sorted(grads),
                      "warnings": caught, "peft": peft.__version__}))


def make(base_dir, out, tokens_file, r, alpha, targets, modules_to_save=""):
    base = base_model(base_dir)
    config = LoraConfig(r=int(r), lora_alpha=float(alpha), target_modules=targets.split(","),
                        modules_to_save=modules_to_save.split(",") if modules_to_save else None,
                        lora_dropout=0.0, task_type="CAUSAL_LM",
                        fan_in_fan_out=base.config.model_type == "gpt2")
    model = get_peft_model(base, config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name or ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.eval()
    model.save_pretrained(out)
    tokens = load_file(tokens_file)["tokens"]
    with torch.no_grad():
        loss = loss_of(model, tokens)
        base_loss = loss_of(base_model(base_dir), tokens)
    print(json.dumps({"loss": loss.item(), "base_loss": base_loss.item()}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"check": check, "make": make}[command](*args)
