"""Measures the NF4 dequantization of a decoder layer's weights: bitsandbytes' against ligertune's
(a GPU).

Findings: docs/PERF.md.

    python3 scripts/probes/nf4.py [--dtype bfloat16]

For Llama-3.1-8B's layer shapes (q, k, v joined; o; gate, up joined; down), each weight quantized
by bitsandbytes as QLoRA stores it (NF4, blocks of 64, double-quantized scales), timed alike
(`bench.timing.measure`, CUDA events, median of 20) into one buffer:

    bitsandbytes   `bitsandbytes.functional.dequantize_4bit(..., out=rows)` per layer: two kernels
                   (the scales, then the weights)
    ligertune      `ligertune.kernels.dequantize_4bit` per layer: one

with the bytes each moves (the codes and scales read, the weights written) and the bandwidth that
makes; the two outputs are checked equal first.
"""

from __future__ import annotations

import argparse

import torch

from ligertune.bench.timing import measure
from ligertune.kernels import dequantize_4bit
from ligertune.models.quantize import block_scales

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
GROUPS = {"q, k, v": [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN)], "o": [(HIDDEN, HIDDEN)],
          "gate, up": [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN)], "down": [(HIDDEN, INTERMEDIATE)]}


def main() -> None:
    import bitsandbytes as bnb

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; ms a group, GB/s")
    total = {"bitsandbytes": 0.0, "ligertune": 0.0}
    for name, shapes in GROUPS.items():
        quantized = [bnb.functional.quantize_4bit(torch.randn(shape, device=device, dtype=dtype) * 0.02, blocksize=64,
                                                  compress_statistics=True, quant_type="nf4") for shape in shapes]
        out = torch.empty(sum(s[0] for s in shapes), shapes[0][1], device=device, dtype=dtype)
        rows = out.split([s[0] for s in shapes])

        def theirs():
            for (packed, state), part in zip(quantized, rows):
                bnb.functional.dequantize_4bit(packed, state, out=part)

        def ours():
            for (packed, state), part in zip(quantized, rows):
                dequantize_4bit(packed, state.code, block_scales(state), part)

        theirs()
        expected = out.clone()
        ours()
        same = torch.equal(out, expected)
        moved = sum(p.numel() + s.absmax.numel() for p, s in quantized) + out.numel() * out.element_size()
        line = f"  {name:<9}"
        for label, fn in (("bitsandbytes", theirs), ("ligertune", ours)):
            ms = measure(fn, device=device, warmup=3, repeats=20, memory=False).median_ms
            total[label] += ms
            line += f"  {label} {ms:6.3f} ms {moved / ms / 1e6:7,.0f} GB/s"
        print(line + ("" if same else "  OUTPUTS DIFFER"))
    print(f"  a layer: bitsandbytes {total['bitsandbytes']:.3f} ms, ligertune {total['ligertune']:.3f} ms; "
          f"x 32 layers x 3 passes (forward, recompute, backward): {96 * total['bitsandbytes']:.1f} and "
          f"{96 * total['ligertune']:.1f} ms a step")


if __name__ == "__main__":
    main()
