"""The coordinator's membership attack on a returned update, and family-aware canaries.

Threat: an honest-but-curious coordinator that receives each site's returned trainable state
every round, and knows the global state the site started from. For a candidate image x with label
y it computes the loss under both,

    d(x) = l(theta_returned; x, y) - l(theta_global; x, y),

and scores membership by ``-d`` (``loss_difference_scores``): training lowers the loss of the images
it used more than that of images it did not. A LiRA-style variant replaces the raw difference by
its likelihood ratio under reference shadows; it needs the same scores under shadow updates.

Canaries (``select_canaries``): candidates are drawn by clearance family, one canary per family,
and a family is wholly on one side. Member canaries stay in training (with their relatives); for
a non-member canary its WHOLE family is withheld from training, since a trained near-duplicate of a
"non-member" would be scored as a member and understate the attack (or, swapped, inflate it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def per_image_losses(model, state: Mapping[str, torch.Tensor], pixels: torch.Tensor, labels: torch.Tensor,
                     descriptor: torch.Tensor | None = None, batch: int = 32) -> torch.Tensor:
    """Unweighted cross-entropy of every image under trainable ``state`` (eval mode, restored after), float64 on the host;
    leaves ``state`` loaded."""
    was_training = model.training
    model.eval()  # no dropout: the coordinator's loss is a deterministic function of the state
    model.load_trainable_state(dict(state))
    out = []
    try:
        for start in range(0, len(labels), batch):
            logits, _ = model(pixels[start:start + batch], descriptor)
            out.append(F.cross_entropy(logits.double(), labels[start:start + batch].to(logits.device),
                                       reduction="none").cpu())
    finally:
        model.train(was_training)
    return torch.cat(out)


def loss_difference_scores(model, global_state: Mapping[str, torch.Tensor], returned_state: Mapping[str, torch.Tensor],
                           pixels: torch.Tensor, labels: torch.Tensor, descriptor: torch.Tensor | None = None,
                           batch: int = 32) -> np.ndarray:
    """Membership score of each candidate: loss under the global state minus loss under the returned state
    (higher: more likely trained on). The model's own trainable state and mode are restored afterwards."""
    if len(pixels) != len(labels):
        raise ValueError(f"{len(pixels)} candidate images for {len(labels)} labels")
    own = model.trainable_state()
    try:
        before = per_image_losses(model, global_state, pixels, labels, descriptor, batch)
        after = per_image_losses(model, returned_state, pixels, labels, descriptor, batch)
    finally:
        model.load_trainable_state(own)
    return (before - after).numpy()


@dataclass(frozen=True)
class CanarySplit:
    members: list[str]        # canaries that train (their families' other images train as usual)
    nonmembers: list[str]     # canaries held out
    withheld: list[str]       # every image of a non-member canary's family: remove from the site's training
    member_families: list[str]
    nonmember_families: list[str]


def select_canaries(image_ids: Sequence[str], family_of: Mapping[str, str], per_side: int,
                    rng: np.random.Generator) -> CanarySplit:
    """``per_side`` member and ``per_side`` non-member canaries from a site's images, one per family, each
    family on one side at random. An image without a family entry is a family of its own."""
    if per_side < 1:
        raise ValueError(f"need at least one canary per side, got {per_side}")
    families: dict[str, list[str]] = defaultdict(list)
    for i in image_ids:
        families[family_of.get(i) or f"image:{i}"].append(i)
    names = sorted(families)
    if len(names) < 2 * per_side:
        raise ValueError(f"{2 * per_side} canary families requested but the site has {len(names)} families")
    chosen = [names[k] for k in rng.permutation(len(names))[: 2 * per_side]]
    member_fams, non_fams = sorted(chosen[:per_side]), sorted(chosen[per_side:])
    pick = {f: sorted(families[f])[int(rng.integers(len(families[f])))] for f in chosen}
    return CanarySplit(members=[pick[f] for f in member_fams], nonmembers=[pick[f] for f in non_fams],
                       withheld=sorted(i for f in non_fams for i in families[f]),
                       member_families=member_fams, nonmember_families=non_fams)
