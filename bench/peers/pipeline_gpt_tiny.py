#!/usr/bin/env python3
"""The PyTorch peer of `troupe bench pipeline --peer`: the gpt-tiny of train_gpt_tiny.py (model, AdamW,
data: imported from it, not copied) trained as a pipeline with torch.distributed.pipelining over Gloo,
one process per stage on loopback (torch.multiprocessing spawn) — what a PyTorch user writes for the
pipeline troupe's stage actors run.

The cut is an even split of the blocks over stages × --virtual-stages chunks (troupe's parameter-balanced
cut for gpt-tiny): the first chunk also holds the embeddings, the last the final LayerNorm, the head and
the loss; chunk c runs on rank c mod stages. Each step: --microbatches micro-batches of --micro-batch-size
samples of --context tokens (one global batch) through the schedule (GPipe, 1F1B, interleaved 1F1B, or
ZB-H1 as PyTorch's ScheduleInterleavedZeroBubble with one stage per rank, its zero-bubble schedule of
B/W-split backwards), then the global gradient norm over all stages (all-reduced, as troupe's flush
does), clipping at 1.0, AdamW on each rank's own parameters.

Printed (one JSON line): tokens_per_s, the global batch's tokens of the timed steps over the last stage's
wall time; the mean loss of the last step; bubble is not measured here (PyTorch records no per-op
timeline by default).

Run with the provisioned torch:
/root/.cache/troupe/venv-torch-2.11.0/bin/python bench/peers/pipeline_gpt_tiny.py --stages 2 --microbatches 4
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_allreduce import free_port, timed_steps  # noqa: E402
from train_gpt_tiny import Gpt, corpus, make_optimizer, sample_batch  # noqa: E402

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
}
# Schedules written for several stages per rank, taking a list of them.
MULTI_STAGE = {"interleaved", "zb-h1"}


class Stage(nn.Module):
    """Blocks `blocks` of `model`, with the embeddings on the first stage and ln_f + head on the last."""

    def __init__(self, model, blocks, first, last):
        super().__init__()
        # Kept from the one model built on every rank, so every stage starts from the same init.
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        self.h = nn.ModuleList(model.h[i] for i in blocks)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.h:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rank_main(rank, args, port, results):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    torch.manual_seed(0)
    model = Gpt(vocab=args.vocab, context=args.context, layers=args.layers)
    # Chunk c of stages × virtual stages runs on rank c mod stages (Megatron's interleaving).
    chunks = args.stages * args.virtual_stages
    per = args.layers // chunks
    mine = list(range(rank, chunks, args.stages))
    modules = [
        Stage(model, range(c * per, args.layers if c == chunks - 1 else (c + 1) * per), c == 0, c == chunks - 1)
        for c in mine
    ]
    del model
    stages = [PipelineStage(m, c, chunks, torch.device("cpu")) for m, c in zip(modules, mine)]
    schedule = SCHEDULES[args.schedule](
        stages if args.schedule in MULTI_STAGE else stages[0], args.microbatches, loss_fn=loss_fn
    )
    module = nn.ModuleList(modules)
    first, last = rank == 0, rank == (chunks - 1) % args.stages
    opt = make_optimizer(module)
    data = corpus()
    gen = torch.Generator().manual_seed(0)
    batch = args.micro_batch_size * args.microbatches

    def step():
        x, y = sample_batch(data, gen, batch, args.context)
        opt.zero_grad(set_to_none=True)
        losses = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        # The global gradient norm over every stage's parameters, then clip and step (troupe's flush).
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(sq)
        coef = min(1.0, 1.0 / (sq.sqrt().item() + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        opt.step()
        return torch.stack(losses).mean().item() if losses else float("nan")

    elapsed, loss = timed_steps(step, args.warmup, args.steps)
    results[rank] = {"seconds": elapsed, "loss": loss}
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    args = ap.parse_args()
    if args.layers < args.stages * args.virtual_stages:
        sys.exit(f"--layers {args.layers} cannot fill --stages {args.stages} x --virtual-stages {args.virtual_stages}")
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(args, free_port(), results), nprocs=args.stages, join=True)
    last = results[(args.stages * args.virtual_stages - 1) % args.stages]
    tokens = args.steps * args.micro_batch_size * args.microbatches * args.context
    print(json.dumps({
        "peer": "pytorch-pipelining-gloo", "torch": torch.__version__, "schedule": args.schedule,
        "stages": args.stages, "virtual_stages": args.virtual_stages, "microbatches": args.microbatches, "micro_batch_size": args.micro_batch_size,
        "layers": args.layers, "vocab": args.vocab, "context": args.context, "steps": args.steps,
        "torch_threads": args.threads, "tokens_per_s": tokens / last["seconds"], "final_loss": last["loss"],
    }))


if __name__ == "__main__":
    main()
