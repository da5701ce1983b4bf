"""Hugging Face transformers' Adafactor, the oracle of troupe's (kernels/model/tests/adafactor_vs_transformers.rs).

    oracle.py IN OUT HYPER_JSON

IN (safetensors): the initial parameters `p.{i}` and the gradient of every step `g.{step}.{i}`. HYPER_JSON:
the optimizer's keyword arguments (`eps` a pair) plus `steps` and `lrs` (the lr of each step; ignored with
relative_step). Runs transformers.optimization.Adafactor over the steps, one parameter group, and writes the
final parameters `p.{i}` and every state tensor `{name}.{i}` (exp_avg, exp_avg_sq_row, exp_avg_sq_col,
exp_avg_sq) to OUT. Prints one JSON line.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers.optimization import Adafactor


def main():
    inputs, out, hyper = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tensors = load_file(inputs)
    count = sum(1 for name in tensors if name.startswith("p."))
    params = [torch.nn.Parameter(tensors[f"p.{i}"].clone()) for i in range(count)]
    steps, lrs = hyper.pop("steps"), hyper.pop("lrs")
    hyper["eps"] = tuple(hyper["eps"])
    lr = None if hyper["relative_step"] else lrs[0]
    opt = Adafactor(params, lr=lr, **hyper)
    for step in range(steps):
        if not hyper["relative_step"]:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        for i, p in enumerate(params):
            p.grad = tensors[f"g.{step}.{i}"].clone()
        opt.step()
    result = {f"p.{i}": p.detach().contiguous() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for name, value in opt.state[p].items():
            if torch.is_tensor(value) and name != "RMS":
                result[f"{name}.{i}"] = value.contiguous()
    save_file(result, out)
    print(json.dumps({"steps": steps, "tensors": len(result)}))


if __name__ == "__main__":
    main()
