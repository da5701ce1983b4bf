#!/usr/bin/env python3
"""The PyTorch peer of `troupe bench recovery`: surviving the loss of a worker the torchrun (TorchElastic)
way, i.e. restart the whole worker group and resume from the last checkpoint.

`main` runs, in one command,
  python -m torch.distributed.run --nproc-per-node N --max-restarts 1 --rdzv-backend c10d
      --rdzv-endpoint 127.0.0.1:PORT --monitor-interval 0.1 <this script> --worker ...
where each worker trains the gpt-tiny of train_gpt_tiny.py data-parallel (DDP over Gloo, micro-batch 8 of
context 128 per rank, 1 torch thread per rank: as in ddp_gpt_tiny.py). After every step rank 0 saves a
checkpoint (model + optimizer state + step, torch.save to a temporary file renamed into place) and appends
"step,<n>,<time.time()>" to a log. After step K (checkpointed: the ranks meet at a barrier once rank 0 has
saved it) the highest rank appends "kill,<time>" and SIGKILLs itself, in the first run only
(TORCHELASTIC_RESTART_COUNT == 0). The agent notices the dead worker, stops the survivors, re-rendezvouses
and starts a new group, which loads the checkpoint and continues.

Printed (one JSON line): recovery_s, the kill to the first step committed after the restart; detect_s, the
kill to the agent's first log line on the failure (SIGTERM to the survivors; its timestamp, to the ms;
null when it cannot be found); restart_s,
the kill to the restarted rank 0 running Python; steps_redone, steps logged twice.

The restart needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set by main; see there): without it torchrun's own
restart fails on this torch (2.11) with Gloo.

/root/.cache/troupe/venv-torch-2.11.0/bin/python bench/peers/torchrun_recovery.py --nodes 3 --kill-at-step 5
"""
import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time


def log_line(path, *fields):
    with open(path, "a") as f:
        f.write(",".join(str(x) for x in fields) + "\n")
        f.flush()
        os.fsync(f.fileno())


def worker(args):
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    log = os.path.join(args.dir, "log")
    if rank == 0:
        log_line(log, "start", restart, time.time())

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_gpt_tiny import Gpt, corpus, make_optimizer, sample_batch, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(Gpt(context=args.context))
    opt = make_optimizer(model)
    ckpt = os.path.join(args.dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    data = corpus()
    gen = torch.Generator()
    while step < args.steps:
        step += 1
        gen.manual_seed(rank * 1_000_003 + step)  # the batch of (rank, step), the same after a restart
        train_step(model, opt, *sample_batch(data, gen, args.micro_batch, args.context))
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            log_line(log, "step", step, time.time())
        if step == args.kill_at_step and restart == 0:
            dist.barrier()  # step K is checkpointed before the kill
            if rank == world - 1:
                log_line(log, "kill", time.time())
                os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glog-style prefix of torch's loggers: "I0514 12:34:56.789000 1234 path.py:123] message"
# The agent's first lines on a dead worker: it SIGTERMs the survivors, then logs the failure and the restart.
AGENT_LINE = re.compile(r"^[IWE](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d+) "
                        r".*(closing signal SIGTERM|failed \(exitcode|Worker group FAILED)")


def agent_detect_time(stderr):
    """time.time() of the agent's first line on the failure (see AGENT_LINE), or None."""
    for line in stderr.splitlines():
        m = AGENT_LINE.match(line)
        if m:
            month, day, hour, minute, sec, frac = m.groups()[:6]
            now = datetime.datetime.now()
            t = datetime.datetime(now.year, int(month), int(day), int(hour), int(minute), int(sec),
                                  int(frac.ljust(6, "0")[:6]))
            return t.timestamp()
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3, help="workers (ranks); the highest is killed")
    ap.add_argument("--kill-at-step", type=int, default=5)
    ap.add_argument("--steps-after", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--worker", action="store_true", help="(internal) run as a torchrun worker")
    ap.add_argument("--dir", help="(internal) the checkpoint and log directory")
    ap.add_argument("--steps", type=int, help="(internal) total steps")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import torch

    with tempfile.TemporaryDirectory() as d:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nodes),
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--monitor-interval", "0.1", os.path.abspath(__file__), "--worker", "--dir", d,
            "--steps", str(args.kill_at_step + args.steps_after), "--kill-at-step", str(args.kill_at_step),
            "--micro-batch", str(args.micro_batch), "--context", str(args.context),
        ]
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the default (the agent's TCPStore shared with the workers,
        # torch >= 2.5) the restarted group reads the dead group's Gloo addresses from the same store and
        # init_process_group fails with "connectFullMesh ... Connection refused" (pytorch/pytorch#135712,
        # #167288; still so in torch 2.11). The opt-out gives every rendezvous round its own store.
        env = dict(os.environ, LOGLEVEL="INFO", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            sys.exit(f"torchrun exited with {run.returncode}")
        with open(os.path.join(d, "log")) as f:
            rows = [line.strip().split(",") for line in f if line.strip()]
    at = next(i for i, r in enumerate(rows) if r[0] == "kill")
    kill = float(rows[at][1])
    after = rows[at + 1:]
    restart = next(float(r[2]) for r in after if r[0] == "start")
    first_step = next(r for r in after if r[0] == "step")
    steps = [int(r[1]) for r in rows if r[0] == "step"]
    step_times = [float(r[2]) for r in rows if r[0] == "step"]
    gaps = sorted(b - a for a, b in zip(step_times[2:args.kill_at_step], step_times[3:args.kill_at_step]))
    detected = agent_detect_time(run.stderr)
    print(json.dumps({
        "peer": "torchrun", "torch": torch.__version__, "nodes": args.nodes, "kill_at_step": args.kill_at_step,
        "detect_s": None if detected is None else detected - kill,
        "restart_s": restart - kill,
        "recovery_s": float(first_step[2]) - kill,
        "first_step_after_restart": int(first_step[1]),
        "steps_redone": len(steps) - len(set(steps)), "steps_committed": len(steps),
        "step_s_median": gaps[len(gaps) // 2] if gaps else None,
    }))


if __name__ == "__main__":
    main()
