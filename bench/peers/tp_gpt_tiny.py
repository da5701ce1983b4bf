#!/usr/bin/env python3
"""The PyTorch peer of `troupe bench train --world N --tp T`: gpt-tiny trained with PyTorch's own tensor
parallelism (torch.distributed.tensor.parallel: DTensor's parallelize_module with ColwiseParallel /
RowwiseParallel, SequenceParallel for the norms with --sp) over Gloo on the CPU, N processes on loopback
(torch.multiprocessing spawn, no torchrun), a device mesh of "cpu" shaped (dp, tp) with dp = N / T.

The model is train_gpt_tiny.py's gpt-tiny (pre-LN blocks, exact GeLU, untied head without bias, GPT-2 init,
the same parameter count), its attention's fused qkv linear written as three linears q/k/v (the same
matrix, split by rows): a column-parallel split must give each rank whole heads of q, k and v, which a
column split of the fused [q; k; v] matrix does not. The plan, Megatron's as torchtitan writes it:
- q/k/v and the MLP's first linear: ColwiseParallel; the attention output and the MLP's second linear:
  RowwiseParallel (all-reduce forward; with --sp reduce-scatter to a sequence shard);
- the token embedding: RowwiseParallel (vocab-parallel); the position embedding the same (its table split
  by positions), so each rank adds the positions of its own sequence shard with --sp;
- with --sp: the norms SequenceParallel, the attention and MLP inputs all-gathered by PrepareModuleInput;
  without: the norms are plain replicated modules on a replicated residual stream;
- the head ColwiseParallel (vocab-parallel logits, kept sharded) and the cross-entropy under loss_parallel,
  so the full logits are never gathered on one rank (what troupe does).
AdamW (train_gpt_tiny's settings) on the DTensor shards; gradient-norm clipping at 1.0 by the norm of the
whole model: torch's clip_grad_norm_ cannot take the plain (replicated) norm parameters beside DTensors
without --sp, so the norm is computed here: sharded parameters' squares summed over the tensor group,
replicated ones counted once. With dp > 1 each DTensor's local gradient is all-reduced (mean) over the
data-parallel group of the mesh, plain ones too.

Each data-parallel replica draws --micro-batch samples of --context tokens per step from its own generator
(the tensor ranks of a replica draw the same); --threads torch threads per rank; --warmup untimed steps, a
barrier, then --steps timed steps. Printed (one JSON line): tokens_per_s (the global tokens of the timed
steps over rank 0's wall time), the loss of the first step and of the last, each rank's parameter elements
and peak RSS (getrusage ru_maxrss).

Run with the provisioned torch:
/root/.cache/troupe/venv-torch-2.11.0/bin/python bench/peers/tp_gpt_tiny.py --world 2 --tp 2 --sp 1
"""
import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_allreduce import free_port, timed_steps  # noqa: E402
import train_gpt_tiny  # noqa: E402
from train_gpt_tiny import corpus, make_optimizer, sample_batch  # noqa: E402


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        # Column-parallel q/k/v give this rank heads / T whole heads: the local width says how many.
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, width = q.shape
        q, k, v = (z.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, width))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.mlp_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(train_gpt_tiny.Gpt):
    """train_gpt_tiny.Gpt with q/k/v as three linears; returns the logits (the loss is taken outside, under
    loss_parallel)."""

    def __init__(self, vocab=256, context=128, d=256, layers=4, heads=4):
        super().__init__(vocab, context, d, layers, heads, block=Block)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def parallelize(model, mesh, sp):
    """Megatron's plan on the tensor mesh `mesh` (with `sp`, sequence parallelism: the residual stream and
    the norms sharded along the sequence, dim 1)."""
    stream = Shard(1) if sp else Replicate()
    top = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.h:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=stream),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.mlp_proj": RowwiseParallel(output_layouts=stream),
        }
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather})
        parallelize_module(block, mesh, plan)
    return model


def clip_grad_norm(params, max_norm, tp_group):
    """Clips the gradients to the whole model's norm `max_norm`: a DTensor's squares are its shards' summed
    over the tensor group when it is sharded, its replica's when replicated; a plain parameter is
    replicated. Returns the norm."""
    sharded = torch.zeros(())
    replicated = torch.zeros(())
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            local = g.to_local().float().pow(2).sum()
            if any(placement.is_shard() for placement in g.placements):
                sharded += local
            else:
                replicated += local
        else:
            replicated += g.float().pow(2).sum()
    dist.all_reduce(sharded, group=tp_group)
    total = (sharded + replicated).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(scale)
    return total


def average_over(params, dp_group, dp):
    """Data parallelism on top: each local gradient's mean over the replicas."""
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=dp_group)
            g.div_(dp)


def rank_main(rank, args, port, results):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    dp = args.world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(Gpt(context=args.context), mesh["tp"], bool(args.sp))
    params = list(model.parameters())
    opt = make_optimizer(model)
    data = corpus()
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()

    def step():
        x, y = sample_batch(data, gen, args.micro_batch, args.context)
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        if dp > 1:
            average_over(params, dp_group, dp)
        clip_grad_norm(params, 1.0, tp_group)
        opt.step()
        return loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()

    first_loss = step()
    elapsed, loss = timed_steps(step, max(args.warmup - 1, 0), args.steps)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    results[rank] = {
        "seconds": elapsed,
        "first_loss": first_loss,
        "loss": loss,
        "peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in params),
        "rank_params": local,
    }
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides --world)")
    ap.add_argument("--sp", type=int, default=1, help="1: sequence parallelism (the norms sharded along the sequence)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps, the first of which reports the first loss")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per data-parallel replica per step")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    if args.tp < 1 or args.world % args.tp != 0:
        ap.error(f"--tp {args.tp} must divide --world {args.world}")
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(args, free_port(), results), nprocs=args.world, join=True)
    ranks = [results[r] for r in range(args.world)]
    dp = args.world // args.tp
    tokens = args.steps * args.micro_batch * args.context * dp
    print(json.dumps({
        "peer": "pytorch-dtensor-tp-gloo", "torch": torch.__version__, "world": args.world, "tp": args.tp,
        "sp": bool(args.sp), "dp": dp, "steps": args.steps, "micro_batch": args.micro_batch,
        "global_batch": args.micro_batch * dp, "context": args.context, "torch_threads": args.threads,
        "params": ranks[0]["params"], "rank_params": [r["rank_params"] for r in ranks],
        "tokens_per_s": tokens / ranks[0]["seconds"], "first_loss": ranks[0]["first_loss"],
        "final_loss": ranks[0]["loss"], "peak_mem_bytes_per_rank": [r["peak_mem_bytes"] for r in ranks],
    }))


if __name__ == "__main__":
    main()
