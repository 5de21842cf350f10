"""Seconds to get a site's frozen encoder: rebuilt from its weights folder vs read from the node's encoder file.

For one registry entry (default hibou-b, a ViT-B of ~86 M parameters) with random weights saved in the
hub layout (no download; the load path is a hub model's from its local snapshot), prints the
median of ``--repeat`` runs of

1. the rebuild a worker without the file does (``model.encoder.load_encoder`` on the folder:
   construct and randomly initialise the architecture, read the safetensors, translate, load);
2. the read of the node's encoder file (``federation.encoder_cache``: construct on ``meta``, assign
   the file's tensors), after one rebuild has written it;

and checks that the two encoders are equal tensor for tensor.

    python benchmarks/encoder_cache.py [--encoder hibou-b] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", default="hibou-b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    import fedhisto.federation.site as site
    from fedhisto.config.study import load_config
    from fedhisto.model.encoder import random_encoder

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="enccache-"))
    random_encoder(args.encoder).save(work / "weights")
    cfg = load_config({"model": {"encoder": {"name": args.encoder, "local_dir": str(work / "weights")}}})

    def timed(cache_dir: str) -> tuple[float, object]:
        site._ENCODERS.clear()
        t0 = time.perf_counter()
        enc = site.frozen_encoder(cfg, "", cache_dir)
        return time.perf_counter() - t0, enc

    site.frozen_encoder(cfg, "", str(work / "cache"))  # writes the node's encoder file
    rebuild = [timed("") for _ in range(args.repeat)]
    read = [timed(str(work / "cache")) for _ in range(args.repeat)]
    a, b = rebuild[0][1].module.state_dict(), read[0][1].module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the file's encoder differs"
    n = sum(t.numel() for t in a.values())
    file_mb = sum(p.stat().st_size for p in (work / "cache").glob("encoder-*.pt")) / 2**20
    print(f"{args.encoder}: {n / 1e6:.1f} M values, encoder file {file_mb:.0f} MiB, {args.threads} thread(s)")
    print(f"  rebuilt from its weights folder: {statistics.median(t for t, _ in rebuild):.2f} s (median of {args.repeat})")
    print(f"  read from the node's encoder file: {statistics.median(t for t, _ in read):.2f} s (median of {args.repeat})")


if __name__ == "__main__":
    main()
