#!/usr/bin/env python3
"""The checks of scripts/gpu-check.sh run (issue 31), over binaries unpacked into --bin.

One JSON line per check on stdout (and in $OUT/gpu-check.jsonl when OUT is set):
  {"check": NAME, "status": "passed" | "failed" | "skipped" | "not_built", "seconds": S, ...}
"skipped" is a GPU check that found no CUDA device (every one of them on a machine without a GPU) or,
NCCL's, no NCCL library;
"not_built" a check whose runtime support does not exist yet, with the reason; "failed" carries the
end of the check's output. A benchmark's own JSON report rides along as "report". The first line
describes the device. Exit status 1 if any check failed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

NO_CUDA = "no CUDA device"


def test_check(name, binary, test, limit_s):
    """A Rust test binary run for one test: passed, failed, or skipped where it says no CUDA device."""
    return {"check": name, "cmd": [binary, "--exact", test, "--nocapture", "--test-threads", "1"],
            "limit_s": limit_s, "kind": "test"}


def bench_check(name, args, limit_s):
    """A `troupe bench ... --json` run: its JSON report, or skipped where it fails for want of CUDA."""
    return {"check": name, "cmd": ["troupe", *args], "limit_s": limit_s, "kind": "bench"}


def train_check(name, model, steps, *flags, limit_s=150):
    """`troupe bench train` of `model` in bf16 on the GPU beside its transformers peer (the same command
    times both): context 1024, micro-batch 8, one repeat of `steps` steps, plus `flags`."""
    return bench_check(name, ["bench", "train", "--device", "cuda", "--precision", "bf16", "--model", model,
                              "--context", "1024", "--micro-batch", "8", "--steps", str(steps), "--repeats", "1",
                              "--peer", *flags, "--json"], limit_s)


def not_built(name, why):
    return {"check": name, "kind": "not_built", "why": why}


CHECKS = [
    test_check("cuda_trainer_follows_the_cpu", "cuda_trainer",
               "the_trainer_on_cuda_follows_the_cpu_and_trains_in_bf16", 90),
    test_check("fused_adamw_on_cuda_parameters", "cuda_storage",
               "adamw_on_cuda_parameters_runs_the_fused_kernel_with_the_cpu_bits", 45),
    test_check("nccl_world1_collectives_abort_rebuild", "nccl",
               "one_rank_communicator_runs_every_collective_aborts_and_rebuilds", 45),
    test_check("ddp_on_a_gpu_slot_over_nccl", "gpu_slots",
               "a_ddp_rank_on_a_gpu_slot_sums_over_nccl_and_follows_the_reference", 90),
    test_check("two_ranks_share_the_gpu_over_the_host_plane", "gpu_slots",
               "two_daemons_sharing_a_gpu_sum_through_host_memory_and_follow_the_reference", 90),
    test_check("zero_on_gpu_slots_over_nccl_and_host", "gpu_slots",
               "zero_ranks_on_gpu_slots_reduce_over_nccl_or_host_memory_and_follow_the_reference", 120),
    test_check("tensor_group_on_a_shared_gpu", "gpu_slots",
               "a_tensor_group_sharing_a_gpu_computes_its_shards_there_and_follows_the_reference", 90),
    test_check("periodic_sync_on_a_shared_gpu", "gpu_slots",
               "periodic_replicas_on_a_shared_gpu_step_there_and_follow_the_reference", 90),
    bench_check("fused_kernels_beside_device_copy", ["bench", "kernels", "--device", "cuda", "--json"], 60),
    train_check("smollm2_135m_bf16_beside_pytorch_eager", "smollm2-135m", 20),
    train_check("smollm2_135m_bf16_beside_torch_compile", "smollm2-135m", 20, "--peer-compile"),
    # The largest preset: the MFU target is set on it (the 135M model is too small to fill an H100).
    train_check("tinyllama_1.1b_bf16_beside_pytorch_eager", "tinyllama-1.1b", 10),
    # LoRA fine-tuning of the same 1.1B base beside transformers + PEFT (issue 30's GPU figure): the base is
    # written once as a Hugging Face directory, and both sides read it.
    train_check("tinyllama_1.1b_lora_bf16_beside_peft", "tinyllama-1.1b", 10, "--peft", "lora"),
]


def as_text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def run(check, bin_dir):
    if check["kind"] == "not_built":
        return {"check": check["check"], "status": "not_built", "why": check["why"]}
    cmd = [os.path.join(bin_dir, check["cmd"][0]), *check["cmd"][1:]]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=check["limit_s"])
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        # What it printed before the limit (bytes here, even with text=True).
        out, err, code = as_text(e.stdout), as_text(e.stderr), None
    except OSError as e:  # not carried, not executable
        return {"check": check["check"], "status": "failed", "seconds": 0.0, "detail": f"{cmd[0]}: {e}"}
    line = {"check": check["check"], "seconds": round(time.monotonic() - started, 1)}
    both = out + "\n" + err
    if code is None:
        line.update(status="failed", detail=f"still running after {check['limit_s']} s\n" + tail(both))
    elif check["kind"] == "test" and ": skipped" in out:
        # The test returned early: no CUDA device, or (NCCL's test) no NCCL library; it says which.
        line.update(status="skipped", detail=next(l for l in out.splitlines() if ": skipped" in l).strip())
    elif code != 0 and NO_CUDA in both:
        line.update(status="skipped", detail=next(l for l in both.splitlines() if NO_CUDA in l).strip())
    elif code != 0:
        line.update(status="failed", detail=f"exit {code}\n" + tail(both))
    elif check["kind"] == "test" and " 1 passed" not in out:
        # `--exact` matched no test (renamed?): libtest exits 0 having run nothing.
        line.update(status="failed", detail="the test did not run: " + tail(both, 3))
    else:
        line["status"] = "passed"
        if check["kind"] == "bench":
            reports = []
            for l in out.splitlines():
                if l.startswith("{"):
                    try:
                        reports.append(json.loads(l))
                    except json.JSONDecodeError:
                        pass
            line["report"] = reports[0] if len(reports) == 1 else reports
        else:
            line["detail"] = tail(out, 8)
    return line


def device(commit):
    try:
        import torch  # the python with torch that gpu-check.sh chose
    except ImportError as e:
        return {"check": "device", "commit": commit, "torch": None, "cuda": False, "detail": str(e)}
    info = {"check": "device", "commit": commit, "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True, help="directory of the unpacked binaries")
    p.add_argument("--commit", default="?")
    p.add_argument("--only", default="", help="comma-separated check names: run these alone (a rerun)")
    a = p.parse_args()
    only = [name for name in a.only.split(",") if name]
    unknown = sorted(set(only) - {c["check"] for c in CHECKS})
    if unknown:
        sys.exit(f"gpu_check: no check named {', '.join(unknown)}; the checks: {', '.join(c['check'] for c in CHECKS)}")
    out_dir = os.environ.get("OUT")
    sink = open(os.path.join(out_dir, "gpu-check.jsonl"), "w") if out_dir else None
    failed = False
    emit(device(a.commit), sink)
    for check in CHECKS:
        if only and check["check"] not in only:
            continue
        line = run(check, a.bin)
        failed |= line["status"] == "failed"
        emit(line, sink)
    if sink:
        sink.close()
    sys.exit(1 if failed else 0)


def emit(line, sink):
    text = json.dumps(line)
    print(text, flush=True)
    if sink:
        sink.write(text + "\n")
        sink.flush()


if __name__ == "__main__":
    main()
