#!/usr/bin/env python3
"""The transformers peer of `troupe bench train --world 1 --model PRESET`: transformers' own model of the
config.json troupe writes for the preset (AutoModelForCausalLM.from_config — LlamaForCausalLM,
GPT2LMHeadModel — with PyTorch's SDPA attention), trained eagerly on the same batch shape with the same
optimizer as troupe (AdamW betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices and embeddings,
grad-norm clipping at 1.0), printing one JSON object with tokens_per_s.

Uses the step, optimizer and data of train_gpt_tiny.py, so the two peers measure the same loop.

With --weights the model is the directory's weights (from_pretrained), and with --lora-r it is fine-tuned
with PEFT's LoRA (get_peft_model: r, lora_alpha, target_modules, no dropout) — the peer of
`troupe bench train --peft lora`: the optimizer gets the trainable (adapter) parameters only.
"""
import argparse, os, sys

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt_tiny import TrainableOnly, corpus, make_optimizer, make_scaler, report, sample_batch, train_step  # noqa: E402


class Causal(torch.nn.Module):
    """transformers' model with train_gpt_tiny's forward signature: (tokens, targets) -> mean loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        logits = self.model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), y.view(-1))


def build(config_dir, device="cpu", weights=False, lora=None):
    """(transformers' model of config_dir/config.json wrapped in `Causal`, in fp32 with SDPA attention, in
    training mode on `device`; the config). Also the model bench/peers/ddp_gpt_tiny.py --config-dir trains.
    `weights`: the directory's weights instead of fresh ones; `lora`: (r, alpha, targets) for PEFT's LoRA."""
    config = AutoConfig.from_pretrained(config_dir)
    if weights:
        inner = AutoModelForCausalLM.from_pretrained(config_dir, attn_implementation="sdpa", dtype=torch.float32)
    else:
        inner = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model
        r, alpha, targets = lora
        inner = get_peft_model(inner, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                                 bias="none", task_type="CAUSAL_LM"))
    model = Causal(inner)
    model.to(device)
    model.train()
    return model, config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (troupe bench train --device cuda --peer)")
    ap.add_argument("--weights", type=int, default=0, help="1: load the directory's weights")
    ap.add_argument("--lora-r", type=int, default=0, help="fine-tune with PEFT's LoRA of this rank")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default="")
    ap.add_argument("--compile", type=int, default=0, help="1: torch.compile the model (the compiled peer)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lora = (args.lora_r, args.lora_alpha, args.lora_targets.split(",")) if args.lora_r else None
    model, config = build(args.config_dir, args.device, weights=bool(args.weights), lora=lora)
    opt = make_optimizer(TrainableOnly(model))
    data = corpus() % config.vocab_size
    gen = torch.Generator().manual_seed(0)
    scaler = make_scaler(args.precision, args.device)

    # Compiled: the warm-up steps (untimed) include the compilation.
    runner = torch.compile(model) if args.compile else model

    def step():
        batch = (t.to(args.device) for t in sample_batch(data, gen, args.micro_batch, args.context))
        return train_step(runner, opt, *batch, precision=args.precision, scaler=scaler)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peer = ("transformers-peft" if lora else "transformers") + ("-compile" if args.compile else "-eager")
    report(step, args, model, peer=peer, model_type=config.model_type, trainable_params=trainable)


if __name__ == "__main__":
    main()
