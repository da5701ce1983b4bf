#!/usr/bin/env python3
"""The PyTorch peer of `troupe bench train --world N` (N >= 2): the gpt-tiny of train_gpt_tiny.py (model,
AdamW, grad-norm clipping, data: imported from it, not copied) trained data-parallel with
DistributedDataParallel over Gloo, N processes on loopback (torch.multiprocessing spawn). With
--config-dir DIR (`troupe bench train --world N --model PRESET`, PRESET not gpt-tiny) the model is
transformers' own of DIR/config.json instead, built as train_hf_model.py builds it (AutoModelForCausalLM,
SDPA attention, fp32), the byte corpus taken modulo its vocabulary as there.

With --rank R --master-addr A the script runs rank R alone (the others started elsewhere: `troupe bench
train --netns N --peer` starts one per network namespace) and prints that rank's JSON line.

Each rank: --micro-batch samples of --context tokens per step from its own generator, --threads torch
threads, --warmup untimed steps, a barrier, then --steps timed steps. Printed (one JSON line): tokens_per_s,
the global tokens (all ranks) of the timed steps over rank 0's wall time, and each rank's peak RSS
(getrusage ru_maxrss).

Run with the provisioned torch:
/root/.cache/troupe/venv-torch-2.11.0/bin/python bench/peers/ddp_gpt_tiny.py --world 2 --threads 1
"""
import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_allreduce import free_port, timed_steps  # noqa: E402
from train_gpt_tiny import Gpt, TrainableOnly, corpus, make_optimizer, make_scaler, sample_batch, train_step  # noqa: E402


def build(args):
    """(the model each rank trains, the token corpus, transformers' model_type or None): gpt-tiny, or with
    --config-dir transformers' model."""
    if args.config_dir is None:
        return Gpt(context=args.context), corpus(), None
    from train_hf_model import build as build_hf  # transformers is imported only when it is used

    lora = (args.lora_r, args.lora_alpha, args.lora_targets.split(",")) if args.lora_r else None
    model, config = build_hf(args.config_dir, weights=bool(args.weights), lora=lora)
    return model, corpus() % config.vocab_size, config.model_type


def rank_main(rank, args, port, results, master_addr="127.0.0.1"):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    module, data, model_type = build(args)
    model = DistributedDataParallel(module)  # parameters PEFT froze take no part in its all-reduce
    opt = make_optimizer(TrainableOnly(model))
    gen = torch.Generator().manual_seed(rank)
    scaler = make_scaler(args.precision)

    def step():
        batch = sample_batch(data, gen, args.micro_batch, args.context)
        return train_step(model, opt, *batch, precision=args.precision, scaler=scaler)

    elapsed, loss = timed_steps(step, args.warmup, args.steps)
    results[rank] = {
        "seconds": elapsed,
        "loss": loss,
        "peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in model.parameters()),
        "model_type": model_type,
    }
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="torch.autocast compute precision (fp16 with GradScaler)")
    ap.add_argument("--config-dir", help="train transformers' model of this directory's config.json, not gpt-tiny")
    ap.add_argument("--weights", type=int, default=0, help="1: load the directory's weights")
    ap.add_argument("--lora-r", type=int, default=0, help="fine-tune with PEFT's LoRA of this rank")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default="")
    ap.add_argument("--rank", type=int, help="run only this rank (the others are started elsewhere, e.g. in other "
                    "network namespaces); it prints its own JSON line")
    ap.add_argument("--master-addr", default="127.0.0.1", help="with --rank: rank 0's address")
    ap.add_argument("--master-port", type=int, default=29500, help="with --rank: rank 0's rendezvous port")
    args = ap.parse_args()
    if args.rank is not None:
        results = {}
        rank_main(args.rank, args, args.master_port, results, args.master_addr)
        mine = results[args.rank]
        tokens = args.steps * args.micro_batch * args.context * args.world
        print(json.dumps({
            "peer": "pytorch-ddp-gloo", "torch": torch.__version__, "rank": args.rank, "world": args.world,
            "steps": args.steps, "params": mine["params"], "tokens_per_s": tokens / mine["seconds"],
            "final_loss": mine["loss"], "peak_mem_bytes": mine["peak_mem_bytes"],
        }))
        return
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(args, free_port(), results), nprocs=args.world, join=True)
    ranks = [results[r] for r in range(args.world)]
    tokens = args.steps * args.micro_batch * args.context * args.world
    hf = args.config_dir is not None
    print(json.dumps({
        "peer": ("transformers-peft-ddp-gloo" if args.lora_r else "transformers-ddp-gloo") if hf else "pytorch-ddp-gloo",
        "torch": torch.__version__,
        **({"model_type": ranks[0]["model_type"]} if hf else {}), "world": args.world, "steps": args.steps,
        "precision": args.precision,
        "micro_batch": args.micro_batch, "global_batch": args.micro_batch * args.world, "context": args.context,
        "torch_threads": args.threads, "params": ranks[0]["params"],
        "tokens_per_s": tokens / ranks[0]["seconds"], "final_loss": ranks[0]["loss"],
        "peak_mem_bytes_per_rank": [r["peak_mem_bytes"] for r in ranks],
    }))


if __name__ == "__main__":
    main()
