#!/usr/bin/env python3
"""PyTorch Gloo all-reduce, measured the way `troupe bench allreduce` measures itself.

N processes on loopback (or, with --rank, this process is one rank of N started elsewhere, e.g. each
in its own network namespace by `troupe bench allreduce --netns`, meeting at --master-addr), an f32 tensor of --mib MiB, --warmup untimed iterations, a barrier, then
--iters timed all-reduces (sum). Per rank: seconds per iteration and the CPU time (user and system, every
thread: time.process_time) its process used per iteration; reported: the slowest rank's seconds and the
ranks' CPU summed (cpu_seconds_per_iter), as `troupe bench allreduce` reports its own.
busbw_GBps = bytes / seconds / 1e9 * 2 (n - 1) / n (nccl-tests' definition).

Run with the provisioned torch: /root/.cache/troupe/venv-torch-2.11.0/bin/python gloo_allreduce.py --world 2
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(step, warmup, steps):
    """Runs `step` `warmup` times untimed, then (after a barrier of the process group) `steps` times;
    returns the seconds of the timed ones and the last one's result."""
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    result = None
    for _ in range(steps):
        result = step()
    return time.perf_counter() - start, result


def rank_main(rank, world, port, mib, iters, warmup, threads, results, master_addr="127.0.0.1"):
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(t)
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        dist.all_reduce(t)
    n = max(iters, 1)
    results[rank] = ((time.perf_counter() - t0) / n, (time.process_time() - cpu0) / n)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank", type=int, help="run only this rank (the others are started elsewhere)")
    p.add_argument("--master-addr", default="127.0.0.1", help="with --rank: rank 0's address")
    p.add_argument("--master-port", type=int, default=29500, help="with --rank: rank 0's rendezvous port")
    a = p.parse_args()
    if a.rank is not None:
        results = {}
        rank_main(a.rank, a.world, a.master_port, a.mib, a.iters, a.warmup, a.threads, results, a.master_addr)
        seconds, cpu = results[a.rank]
        print(json.dumps({"name": "gloo", "rank": a.rank, "world": a.world, "seconds_per_iter": seconds,
                          "cpu_seconds_per_iter": cpu}))
        return
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(a.world, free_port(), a.mib, a.iters, a.warmup, a.threads, results), nprocs=a.world, join=True)
    seconds = max(s for s, _ in results.values())
    cpu = sum(c for _, c in results.values())
    nbytes = a.mib * (1 << 20)
    busbw = nbytes / seconds / 1e9 * 2 * (a.world - 1) / a.world if a.world > 1 else 0.0
    report = {"name": "gloo", "world": a.world, "mib": a.mib, "busbw_GBps": busbw, "seconds_per_iter": seconds,
              "cpu_seconds_per_iter": cpu}
    print(json.dumps(report) if a.json else f"gloo world={a.world} {a.mib} MiB: busbw {busbw:.3f} GB/s ({seconds*1e3:.1f} ms/iter)")


if __name__ == "__main__":
    main()
