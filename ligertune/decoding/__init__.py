"""Speculative decoding: propose several tokens, verify them in one forward, keep what the model confirms.

    drafter = make_drafter("ngram")                                # or NgramDraft(depth=5), MedusaDraft(...)
    rule = accept_rule(Sampling(temperature=0.7, top_p=0.9), "exact")
    result = speculative_generate(model, prompt_ids, drafter, rule, max_new_tokens=256, stop_ids=[eos])
    result.ids, result.finish_reason, result.stats.tokens_per_step, result.stats.acceptance_per_depth()

- `tree`: `DraftTree` (candidates sharing prefixes as nodes: token, parent, depth), Medusa's sparse
  tree from the heads' top-k tokens (`medusa_tree`, `sparse_tree_choices`).
- `drafts`: the drafters (`none`, `ngram`, `medusa`) behind one `propose(tokens, hidden)`.
- `verify`: the tree's attention mask and positions, and the acceptance rules: greedy matching
  (the plain greedy answer, token for token), exact rejection sampling (the plain sampling
  distribution), Medusa's typical acceptance (longer runs kept, not the same distribution).
- `generate`: the loop and its statistics (tokens per forward, acceptance per depth).
"""

from ligertune.decoding.drafts import DRAFTS, Drafter, MedusaDraft, NgramDraft, NoDraft, make_drafter
from ligertune.decoding.generate import DecodeStats, Generation, speculative_generate
from ligertune.decoding.tree import DraftTree, medusa_tree, sparse_tree_choices
from ligertune.decoding.verify import ACCEPT_RULES, AcceptRule, Sampling, Verdict, accept_rule

__all__ = [
    "ACCEPT_RULES", "DRAFTS", "AcceptRule", "DecodeStats", "DraftTree", "Drafter", "Generation", "MedusaDraft",
    "NgramDraft", "NoDraft", "Sampling", "Verdict", "accept_rule", "make_drafter", "medusa_tree",
    "sparse_tree_choices", "speculative_generate",
]
