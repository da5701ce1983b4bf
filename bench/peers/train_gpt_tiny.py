#!/usr/bin/env python3
"""The PyTorch peer of `troupe bench train --world 1`: the identical gpt-tiny (DESIGN.md §4), batch and
optimizer, trained eagerly, printing one JSON object with tokens_per_s.

Same model: pre-LN blocks, fused qkv linear, F.scaled_dot_product_attention(is_causal=True), exact GeLU,
untied head without bias, GPT-2 init; AdamW(betas 0.9/0.95, eps 1e-8, wd 0.1 on matrices), grad-norm
clipping at 1.0; micro-batch 8 of context 128 on random byte windows of a synthetic text.

The model, optimizer, data and step are also the ones bench/peers/ddp_gpt_tiny.py trains under DDP.
"""
import argparse, json, math, os, resource, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


def init_weights(model, layers):
    """GPT-2's initialisation, as troupe's: normal(0.02) matrices, the residual projections scaled by
    1/sqrt(2 * layers), zero biases."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


class Gpt(nn.Module):
    """gpt-tiny; `block` builds one transformer block from (d, heads) — the tensor-parallel peer passes its own."""

    def __init__(self, vocab=256, context=128, d=256, layers=4, heads=4, block=Block):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        init_weights(self, layers)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class TrainableOnly:
    """The parameters an optimizer gets: those that require grad (all, unless PEFT froze the base)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return (p for p in self.model.parameters() if p.requires_grad)


def make_optimizer(model):
    """AdamW(betas 0.9/0.95, eps 1e-8), weight decay 0.1 on matrices and embeddings only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def corpus():
    """The synthetic text as a 1-D tensor of byte values."""
    text = (b"the cat sees the red house in the morning.\n" * 30000)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def sample_batch(data, gen, micro_batch, context):
    """`micro_batch` random windows of `context` tokens and their next-token targets."""
    starts = torch.randint(0, len(data) - context - 1, (micro_batch,), generator=gen)
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + context] for s in starts])
    return x, y


def make_scaler(precision, device="cpu"):
    """fp16's dynamic loss scaler (GradScaler defaults: 2^16, x2 per 2000 clean steps); None otherwise."""
    return torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None


def train_step(model, opt, x, y, precision="fp32", scaler=None):
    """One optimizer step (forward, backward, grad-norm clipping at 1.0, AdamW); the loss. bf16/fp16: the
    forward under torch.autocast (fp32 master weights, 16-bit matrix products) — what troupe's
    --precision does; fp16 scales the loss with `scaler`."""
    opt.zero_grad(set_to_none=True)
    if precision == "fp32":
        loss = model(x, y)
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y)
    if scaler is None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (troupe bench train --device cuda --peer)")
    ap.add_argument("--compile", type=int, default=0, help="1: torch.compile the model (the compiled peer)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Gpt(context=args.context).to(args.device)
    opt = make_optimizer(model)
    data = corpus()
    gen = torch.Generator().manual_seed(0)
    scaler = make_scaler(args.precision, args.device)

    # Compiled: the warm-up steps (untimed) include the compilation.
    runner = torch.compile(model) if args.compile else model

    def step():
        batch = (t.to(args.device) for t in sample_batch(data, gen, args.micro_batch, args.context))
        return train_step(runner, opt, *batch, precision=args.precision, scaler=scaler)

    report(step, args, model, peer="pytorch-compile" if args.compile else "pytorch-eager")


def report(step, args, model, **extra):
    """Runs `step` args.warmup times untimed, then args.steps times timed; prints one JSON object with
    tokens_per_s and the run's settings (the peers' common output)."""
    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.micro_batch * args.context
    print(json.dumps({
        **extra, "torch": torch.__version__, "world": 1, "steps": args.steps, "device": args.device,
        "precision": args.precision,
        "micro_batch": args.micro_batch, "context": args.context, "torch_threads": args.threads,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": tokens / elapsed, "final_loss": loss,
        "peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device_mem_bytes": device_memory(args.device),
    }))


def device_memory(device):
    """On a GPU, the device memory this process holds (NVML, as troupe bench train reads its own: the CUDA
    context and the allocator's cached blocks included); None on the CPU or where NVML cannot say."""
    if not str(device).startswith("cuda"):
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        # The peer trains on one GPU: its entry on whichever device lists this process.
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid():
                    return p.usedGpuMemory
        print(f"device memory not reported: NVML lists no process {os.getpid()}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 — the figure is optional; say why it is missing
        print(f"device memory not reported: {e}", file=sys.stderr)
    return None


if __name__ == "__main__":
    main()
