"""What per-sample gradients cost: vmap(grad) against the non-private batch backward and a loop.

Usage (HIBOU-B's shape wants a GPU; ``--encoder tiny`` runs on a CPU)::

    python benchmarks/privacy_per_sample.py [--encoder hibou-b] [--images 8] [--repeats 3] [--chunk 0]

Builds the real PEFT model (LoRA, adapter, FiLM, head) on a randomly initialised encoder of the
exact shape (time does not depend on the weights), v2's per-image objective with two views per
image, and times one micro-batch three ways: the non-private backward of the batch loss, the
per-image gradients of ``fedhisto.privacy.per_sample`` (vmap, eager attention), and a loop of
single-image backward passes (what a per-sample implementation must equal). Prints a Markdown row
per way with seconds per micro-batch and, on CUDA, peak memory.
"""

from __future__ import annotations

import argparse
import time

import torch
from fedhisto.privacy.unit_loss import PastUnitLoss

from fedhisto.config.study import ModelConfig
from fedhisto.model.encoder import ENCODER_SHAPES, random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.privacy.per_sample import per_image_gradients


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return (time.perf_counter() - start) / repeats, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", default="tiny", choices=sorted(ENCODER_SHAPES))
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=0, help="vmap chunk size (0: all images at once)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder(args.encoder), ModelConfig(), film=True).to(device).train()
    size = ENCODER_SHAPES[args.encoder]["image_size"]
    views = torch.rand(args.images, 2, 3, size, size, device=device)
    labels = torch.randint(0, 3, (args.images,), device=device)
    desc = torch.rand(1, 14, device=device)
    loss = PastUnitLoss(ce_weights=torch.ones(3, device=device), weight_js=0.25, weight_feat=0.10)
    params = [p for p in model.parameters() if p.requires_grad]
    trained = {n: None for n, p in model.named_parameters() if p.requires_grad}  # fedavg_peft's declaration

    def batch_backward():
        model.zero_grad()
        logits, z = model(views.flatten(0, 1), desc)  # both views of every image in one forward
        sum(loss(logits[2 * i:2 * i + 2], z[2 * i:2 * i + 2], labels[i]) for i in range(args.images)).backward()

    def per_sample():
        per_image_gradients(model, loss, views, labels, desc, trained=trained, chunk_size=args.chunk or None)

    def loop():
        for i in range(args.images):
            model.zero_grad()
            loss(*model(views[i], desc), labels[i]).backward()
            [p.grad.clone() for p in params]

    print(f"encoder {args.encoder}, {args.images} images x 2 views, device {device}, "
          f"{sum(p.numel() for p in params):,} trainable parameters")
    print("| way | s per micro-batch | peak GiB |\n|---|---|---|")
    for name, fn in (("non-private batch backward", batch_backward), ("per-sample vmap(grad)", per_sample),
                     ("loop of single-image backwards", loop)):
        secs, peak = _time(fn, device, args.repeats)
        print(f"| {name} | {secs:.3f} | {peak:.2f} |")


if __name__ == "__main__":
    main()
