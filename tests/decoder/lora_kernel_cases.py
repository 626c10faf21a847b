"""Kernel cases run in a subprocess with TRITON_INTERPRET=1 (Triton reads it when kernels are defined).

Prints one JSON line per case: max abs error of the Triton and torch backends against a float64
reference, and whether base rows (slot -1) were left bit-identical.
"""

import json
import os
import sys

import torch

from services.decoder.lora.batch import LoRABatch
from services.decoder.lora.torch_backend import TorchLoRABackend
from services.decoder.lora.triton_backend import TritonLoRABackend, bgmv, sgmv

# (num_tokens, in_features, out_features, num_slots, max_rank, ranks per slot, decode fraction)
CASES = [
    (7, 33, 19, 3, 1, (1, 1, 1), 0.5),
    (23, 65, 47, 4, 13, (13, 5, 1, 7), 0.3),
    (37, 50, 130, 5, 64, (64, 1, 17, 33, 8), 0.25),
    (5, 17, 9, 2, 37, (37, 2), 1.0),
    (70, 40, 24, 2, 8, (8, 3), 0.1),   # segments longer than BLOCK_M
]


def make_case(seed, num_tokens, in_f, out_f, num_slots, max_rank, ranks, decode_fraction):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_f, generator=g)
    y0 = torch.randn(num_tokens, out_f, generator=g)
    a = torch.zeros(num_slots, max_rank, in_f)
    b = torch.zeros(num_slots, out_f, max_rank)
    for s, r in enumerate(ranks):  # zero-padded past each adapter's rank, as in the bank
        a[s, :r] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g)
    slots[0] = -1  # base rows always mixed in
    decode = torch.nonzero(torch.rand(num_tokens, generator=g) < decode_fraction).squeeze(1)
    return x, y0, a, b, slots, decode


def reference(x, y0, a, b, slots):
    y = y0.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            y[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return y


def run_case(seed, case):
    x, y0, a, b, slots, decode = make_case(seed, *case)
    ref = reference(x, y0, a, b, slots)
    batch = LoRABatch.build(slots, decode)
    result = {"case": list(case[:5]), "num_decode": int(batch.decode_rows.numel()),
              "num_segments": batch.num_segments}
    base = slots == -1
    outputs = {}
    for name, backend in (("triton", TritonLoRABackend()), ("torch", TorchLoRABackend())):
        y = y0.clone()
        backend.add_lora(y, x, a, b, batch)
        outputs[name] = y
        result[f"{name}_err"] = float((y.double() - ref).abs().max())
        result[f"{name}_base_exact"] = bool(torch.equal(y[base], y0[base]))
    result["triton_vs_torch"] = float((outputs["triton"] - outputs["torch"]).abs().max())
    result["ref_change"] = float((ref - y0.double()).abs().max())  # the correction is not negligible
    # raw kernels straight on every row, slot -1 passed to the kernel itself
    rows = torch.arange(x.shape[0])
    y = y0.clone()
    bgmv(y, x, a, b, rows, slots)
    result["bgmv_raw_err"] = float((y.double() - ref).abs().max())
    y = y0.clone()
    sgmv(y, x, a, b, rows, rows, torch.ones_like(rows), slots, 1)  # one-row segments incl. slot -1
    result["sgmv_raw_err"] = float((y.double() - ref).abs().max())
    return result


def main():
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.manual_seed(0)
    for i, case in enumerate(CASES):
        print(json.dumps(run_case(i, case)), flush=True)


if __name__ == "__main__":
    main()
