"""Measures best-fit-decreasing packing of many conversation lengths (target: 1M lengths in under 10 s).

Findings: docs/data.md, "Packing" (the time and the packing efficiency of a million chat-like lengths).

    python scripts/probes/packing.py                      # 1M lengths, max_seq_len 2048, three mixes
    python scripts/probes/packing.py --n 200000 --max-seq-len 8192 --full

Length mixes: `chat` is log-normal (median ~300 tokens, long tail) like multi-turn chat data,
`short` has mostly short exchanges (median ~90), `uniform` is uniform on [8, max_seq_len], the
hardest case for the room index (most distinct rooms). `--full` also times `pack()` building the
packs' token lists from synthetic examples of those lengths (more memory: n * mean length ints).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from ligertune.data.chat import IGNORE_INDEX, TokenizedExample
from ligertune.data.packing import best_fit_decreasing, pack


def lengths_of(mix: str, n: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(f"bench-packing:{mix}:{seed}")
    if mix == "uniform":
        return [rng.randint(8, max_len) for _ in range(n)]
    mu = {"chat": math.log(300), "short": math.log(90)}[mix]
    return [min(max_len, max(8, int(rng.lognormvariate(mu, 0.9)))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="number of conversations")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    mixes = ["chat", "short", "uniform"]
    parser.add_argument("--mix", choices=mixes, nargs="*", default=mixes)
    parser.add_argument("--full", action="store_true", help="also time pack() on synthetic examples")
    args = parser.parse_args()

    print(f"{'mix':8} {'n':>9} {'max_len':>7} {'mean':>7} {'packs':>8} {'efficiency':>10} {'seconds':>8}")
    for mix in args.mix:
        lengths = lengths_of(mix, args.n, args.max_seq_len, args.seed)
        start = time.perf_counter()
        bins = best_fit_decreasing(lengths, args.max_seq_len)
        seconds = time.perf_counter() - start
        efficiency = sum(lengths) / (len(bins) * args.max_seq_len)
        print(f"{mix:8} {args.n:>9,} {args.max_seq_len:>7} {sum(lengths) / len(lengths):>7.1f} "
              f"{len(bins):>8,} {efficiency:>10.2%} {seconds:>8.2f}")
        if args.full:
            examples = [TokenizedExample([1] * n, [IGNORE_INDEX] + [1] * (n - 1)) for n in lengths]
            start = time.perf_counter()
            packs = pack(examples, args.max_seq_len)
            print(f"{'':8} pack(): {len(packs):,} packs built in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
