"""A loaded package as a model: the frozen encoder it names, each member's state, and their ensemble.

The model is the pipeline's own ``FedHistoModel`` built from the package's model settings, and the
probabilities come from ``train.inference.predict`` with the package's evaluation transform, so a
package classifies an image exactly as the ``predict`` stage scored it.

Encoder: the package's own ``encoder/`` folder when it carries one (an encoder no hub holds); else
``--encoder-dir`` (a local snapshot, checked against the digest recorded at export when there was
one) or the hub at the recorded revision. A folder of another encoder is refused, naming both.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fedhisto.data.splits import Split
from fedhisto.export.package import Package, PackageError
from fedhisto.infra.progress import Progress
from fedhisto.infra.provenance import digest_path


def load_package_encoder(pkg: Package, encoder_dir: str | Path | None):
    from fedhisto.config.model_settings import EncoderConfig
    from fedhisto.model.encoder import EncoderLoadError, load_encoder, load_encoder_folder

    enc = pkg.meta["encoder"]
    name = enc["name"]
    if encoder_dir is not None:
        recorded = enc.get("folder_digest")
        if recorded and digest_path(encoder_dir) != recorded:
            raise PackageError(f"--encoder-dir {encoder_dir}: not the encoder this package was trained on ({name!r}, "
                               f"folder digest {recorded[:12]}); its files differ")
        folder = Path(encoder_dir)
    elif enc.get("included"):
        folder = pkg.root / enc["included"]
    else:
        folder = None
    try:
        if folder is not None:
            encoder = load_encoder_folder(folder, name)
        else:
            encoder = load_encoder(EncoderConfig(name=name, repo_id=enc["repo_id"], revision=enc["revision"]))
    except EncoderLoadError as exc:
        raise PackageError(f"the package's encoder is {name!r} ({enc['architecture']}); {exc}") from None
    for p in encoder.module.parameters():
        p.requires_grad_(False)
    encoder.module.eval()
    return encoder


def build_package_model(pkg: Package, encoder_dir: str | Path | None = None):
    from fedhisto.config.model_settings import ModelConfig
    from fedhisto.model.peft_model import FedHistoModel

    model_cfg = ModelConfig.model_validate(pkg.meta["model"])
    if model_cfg.encoder.name != pkg.encoder_name:
        raise PackageError(f"{pkg.root}: model settings name encoder {model_cfg.encoder.name!r}, the package "
                           f"{pkg.encoder_name!r}")
    torch.manual_seed(0)  # LoRA initialisation is overwritten by every member's state; fixed anyway
    return FedHistoModel(load_package_encoder(pkg, encoder_dir), model_cfg, film=pkg.meta["method"]["film"])


def eval_settings(pkg: Package) -> SimpleNamespace:
    """What ``train.inference.predict`` reads of a config: the views and the evaluation batch."""
    from fedhisto.config.data_settings import ViewsConfig

    return SimpleNamespace(views=ViewsConfig.model_validate(pkg.meta["views"]),
                           evaluate=SimpleNamespace(eval_batch=pkg.meta["eval_batch"]))


def member_probabilities(pkg: Package, images: list[np.ndarray], descriptor: np.ndarray | None,
                         encoder_dir: str | Path | None = None, threads: int = 1,
                         device: str = "auto") -> dict[str, np.ndarray]:
    """Per member, the (N x 3) probabilities, uncalibrated (softmax of the logits); ``device`` as
    ``train.device`` (``model.build.device_for``)."""
    return member_outputs(pkg, images, descriptor, encoder_dir, threads, device=device)[0]


def member_outputs(pkg: Package, images: list[np.ndarray], descriptor: np.ndarray | None,
                   encoder_dir: str | Path | None = None, threads: int = 1,
                   feature_descriptor: np.ndarray | None = None,
                   device: str = "auto") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per member, the (N x 3) uncalibrated probabilities with ``descriptor`` and the adapted embeddings with
    ``feature_descriptor`` (the package's default, the one its domain statistics were taken with): the same
    forward pass when the two descriptors agree or no feature descriptor is given, a second one otherwise."""
    from fedhisto.model.build import device_for
    from fedhisto.train.inference import predict_with_embeddings

    torch.set_num_threads(max(threads, 1))
    device = device_for(device)
    model = build_package_model(pkg, encoder_dir).to(device)
    split = Split([str(i) for i in range(len(images))], [0] * len(images), images)
    desc = None if descriptor is None else torch.tensor(descriptor, dtype=torch.float32)
    fdesc = None if feature_descriptor is None else torch.tensor(feature_descriptor, dtype=torch.float32)
    # no feature descriptor asked for (probabilities only): the embeddings are those of the same pass
    same = fdesc is None or (desc is not None and torch.equal(desc, fdesc))
    cfg = eval_settings(pkg)
    probs, feats = {}, {}
    with Progress(len(pkg.members), "classify: members", "model") as bar:
        for name, state in pkg.members.items():
            model.load_trainable_state(state)
            p, z = predict_with_embeddings(model, split, desc, cfg, device)
            if not same:
                z = predict_with_embeddings(model, split, fdesc, cfg, device)[1]
            probs[name], feats[name] = p.numpy().astype(np.float64), z.numpy().astype(np.float64)
            bar.update()
    return probs, feats
