"""Measures what verifying a Medusa draft tree costs against one decoding forward, at batch 1.

A model of Llama-3.1-8B's shapes (random bf16 weights, SDPA attention) holds a KV cache of
CONTEXT tokens. Timed, each the median of REPEATS forwards (`ligertune.bench.timing.measure`), the cache
cropped back after each:

    decode          one token (plain decoding's step)
    tree N          1 pending token + an N-node tree from `default_medusa_choices` (4 heads), with the
                    tree mask and positions `speculative_generate` passes

At batch 1 a forward reads every weight once, so a few dozen more query rows should cost little; the
table says how much. Usage (on the GPU; `--layers 1` makes a quick check on a CPU):

    python3 scripts/probes/tree_verify.py [--context 1024] [--model llama-3.1-8b]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from ligertune.bench.timing import measure
from ligertune.decoding.drafts import default_medusa_choices
from ligertune.decoding.tree import medusa_tree
from ligertune.decoding.verify import AttentionLayout, cache_keyword, tree_positions
from ligertune.models import build_model
from ligertune.models.presets import preset_fields
from ligertune.recipe import ModelConfig

REPEATS = 30


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--sizes", default="16,32,64,128")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = dict(preset_fields(args.model), **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = build_model(ModelConfig(config=config, attention="sdpa"), device=device,
                        dtype=torch.bfloat16, seed=0).eval()
    vocab = model.config.vocab_size
    layout, cache_kw = AttentionLayout.of(model.config), cache_keyword(model)

    def timed(forward) -> float:
        return measure(forward, device=device, warmup=3, repeats=args.repeats, memory=False).median_ms

    cache = DynamicCache()
    prompt = torch.randint(0, vocab, (1, args.context), device=device)
    model(input_ids=prompt, use_cache=True, **{cache_kw: cache})
    past = args.context

    def decode():
        model(input_ids=torch.randint(0, vocab, (1, 1), device=device),
              position_ids=torch.tensor([[past]], device=device), use_cache=True, **{cache_kw: cache})
        cache.crop(-1)

    rows = [("decode", 1, timed(decode))]
    for size in [int(s) for s in args.sizes.split(",")]:
        topk = torch.randint(0, vocab, (4, 10)).tolist()
        tree = medusa_tree(topk, default_medusa_choices(4, size))
        ids = torch.tensor([[int(prompt[0, -1]), *tree.tokens]], device=device)
        positions = tree_positions(tree, past=past - 1, pending=1)[None].to(device)
        mask = layout.masks(tree, past=past - 1, pending=1, dtype=torch.bfloat16, device=torch.device(device))
        cache.crop(-1)  # the root is pending: its entry is recomputed with the tree, as generation does

        def verify(ids=ids, positions=positions, mask=mask, n=len(tree) + 1):
            model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                  **{cache_kw: cache})
            cache.crop(-n)

        rows.append((f"tree {len(tree)}", len(tree) + 1, timed(verify)))
        model(input_ids=ids[:, :1], position_ids=positions[:, :1], use_cache=True, **{cache_kw: cache})
    base = rows[0][2]
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{args.model} ({model.config.num_hidden_layers} layers), context {args.context}, {where}")
    print("| forward | query tokens | ms | against decode |\n|---|---:|---:|---:|")
    for name, queries, ms in rows:
        print(f"| {name} | {queries} | {ms:.2f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
