"""Cohort sizes: how many originals each synthetic site renders per class.

A profile states the partition targets (client pools, global validation and test) and the
external cohort. Client ``Ck`` draws its pool from ``site{k}``; the global validation and
test images are spread over the sites that carry each class (site5, the WSSS4LUAD-like
source, has no SCC), so every partition mixes stains the way the study's corpus mixes sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhisto import CLASSES

Counts = tuple[int, int, int]


@dataclass(frozen=True)
class CohortProfile:
    clients: dict[str, Counts]   # pre-holdout pools, C1..C5
    validation: Counts
    test: Counts
    external: Counts
    spare: Counts = (0, 0, 0)    # internal originals beyond the targets (rendered, left unused by the manifest)
    holdouts: dict[str, Counts] | None = None  # per client, drawn from its pool; None: manifest.holdout_fraction

    @property
    def internal_total(self) -> int:
        return sum(map(sum, self.clients.values())) + sum(self.validation) + sum(self.test) + sum(self.spare)

    def site_counts(self) -> dict[str, dict[str, int]]:
        """Originals per internal site and class: the client's pool plus its share of val/test (and spares)."""
        sites = {f"site{k + 1}": dict(zip(CLASSES, pool, strict=True))
                 for k, pool in enumerate(self.clients.values())}
        for c, cls in enumerate(CLASSES):
            carriers = [s for s, counts in sites.items() if counts[cls] > 0]
            extra = self.validation[c] + self.test[c] + self.spare[c]
            base, rem = divmod(extra, len(carriers))
            for i, s in enumerate(carriers):
                sites[s][cls] += base + (1 if i < rem else 0)
        return sites


PROFILES: dict[str, CohortProfile] = {
    # Table 2 of the study: 8,922 internal images; LungHist700-sized external cohort.
    "paper": CohortProfile(
        clients={"C1": (229, 208, 293), "C2": (485, 439, 65), "C3": (187, 172, 318),
                 "C4": (64, 58, 553), "C5": (1181, 1831, 0)},
        validation=(472, 474, 473),
        test=(473, 475, 472),
        external=(280, 151, 260),
    ),
    # Same skew pattern (C1 balanced, C2 SCC-minority, C3 SCC-enriched, C4 SCC-majority,
    # C5 SCC-absent) at a size that trains every method on 2 CPU cores in minutes.
    "small": CohortProfile(
        clients={"C1": (12, 11, 14), "C2": (22, 20, 4), "C3": (9, 9, 16),
                 "C4": (4, 4, 26), "C5": (26, 38, 0)},
        validation=(12, 12, 12),
        test=(12, 12, 12),
        external=(24, 16, 24),
    ),
    # The embedded default: "small"'s optimisation sets and validation (training costs what it did), with
    # evaluation sets large enough that one method's macro-F1 has a 95 % image-bootstrap interval of at
    # most about +/-0.03 (docs/getting-started.md, "Evaluation set sizes"): an internal test of 600 images and
    # the external cohort at the study's size and mix (LungHist700: 280 ACA / 151 Normal / 260 SCC). Each
    # site's holdout is 30 images (small's 10 % holdouts were 3 to 10 images, too few to tell one site's
    # macro-F1 from another's): the pool's class mix, at least 5 of each class the site has; each pool is
    # small's optimisation set plus that holdout.
    "small_eval": CohortProfile(
        clients={"C1": (21, 19, 24), "C2": (33, 30, 9), "C3": (16, 16, 28),
                 "C4": (9, 9, 43), "C5": (34, 50, 0)},
        holdouts={"C1": (10, 9, 11), "C2": (13, 12, 5), "C3": (8, 8, 14), "C4": (5, 5, 20), "C5": (12, 18, 0)},
        validation=(12, 12, 12),
        test=(200, 200, 200),
        external=(280, 151, 260),
        # clearance links a few distinct originals by chance among 1,600 images (2 ACA short under
        # family_policy: representatives without spares): 10 spares per class keep the targets met
        spare=(10, 10, 10),
    ),
    # Half of "small", same skew pattern: the training and Flower tests' shared cohort (every run on it
    # costs about half). Not a study size.
    "tiny": CohortProfile(
        clients={"C1": (6, 6, 7), "C2": (11, 10, 2), "C3": (5, 5, 8),
                 "C4": (2, 2, 13), "C5": (13, 19, 0)},
        validation=(6, 6, 6),
        test=(6, 6, 6),
        external=(12, 8, 12),
    ),
}
