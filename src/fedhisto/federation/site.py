"""A site's half of a federated round, without Flower: its data, its model, its method hooks.

The ClientApp (``client_app``) decodes messages into these calls and encodes the results; nothing
here imports flwr. A site reads only its own rows of a manifest (``client == site`` and split
``optimisation``; the evaluation site also its ``validation`` rows), in the same order and with the
same decoding as ``train.data.load_partitions``, so that a site's ``local_train`` is bitwise the
in-process engine's.

Models and data are cached per process (``_MODELS``/``_DATA``): a warm worker (Flower's
Simulation Engine keeps its Ray actors) builds the encoder once; a deployed SuperNode starts one
``flwr-clientapp`` process per message, so it pays the build every message (docs/federation.md).
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fedhisto import CLASSES
from fedhisto.config import Config, load_config
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, Method
from fedhisto.model.build import build_model, encoder_digest, pick_device
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.splits import Split, _load
from fedhisto.train.inference import predict
from fedhisto.train.local import LocalResult, local_train
from fedhisto.train.loop import ClientUnavailable
from fedhisto.train.participants import validate_members

_MODELS: dict[tuple, tuple[Method, FedHistoModel]] = {}
_DATA: dict[tuple, Split] = {}


@dataclass
class SiteConfig:
    """One site, as its SuperNode's node config names it (``site-id``, ``manifest``, ``descriptors``,
    optional ``encoder-dir`` and ``threads``)."""

    site: str
    manifest: str
    descriptors: str = ""
    encoder_dir: str = ""
    threads: int = 1

    @classmethod
    def from_node_config(cls, node_config: dict, run_config: dict) -> SiteConfig:
        """Deployment: the SuperNode's ``--node-config``. Simulation (virtual nodes only get a
        ``partition-id``): partition k is the k-th site of the run config's sorted ``sites``, reading
        the run config's ``sim-manifest``/``sim-descriptors``."""
        if "site-id" in node_config:
            return cls(str(node_config["site-id"]), str(node_config.get("manifest", "")),
                       str(node_config.get("descriptors", "")), str(node_config.get("encoder-dir", "")),
                       int(node_config.get("threads", 1)))
        sites = sorted(s.strip() for s in str(run_config["sites"]).split(",") if s.strip())
        return cls(sites[int(node_config["partition-id"])], str(run_config.get("sim-manifest", "")),
                   str(run_config.get("sim-descriptors", "")), str(run_config.get("encoder-dir", "")),
                   int(run_config.get("threads", 1)))


def config_from_json(text: str) -> Config:
    return load_config(json.loads(text))


def load_site_split(manifest_csv: str, site: str | None, split: str, crop_size: int) -> Split:
    """``site``'s rows of one split (``site=None``: all rows of the split), as ``load_partitions``."""
    key = (str(Path(manifest_csv).resolve()), site, split, crop_size)
    if key in _DATA:
        return _DATA[key]
    try:
        with Path(manifest_csv).open() as fh:
            rows = [r for r in csv.DictReader(fh) if r["split"] == split and (site is None or r["client"] == site)]
        rows.sort(key=lambda r: r["sample_id"])
        data = Split([r["sample_id"] for r in rows], [CLASSES.index(r["label"]) for r in rows],
                     [_load(r["path"], 2 * crop_size) for r in rows])
    except OSError as exc:  # the site's data cannot be read: declared unavailability
        raise ClientUnavailable(f"site {site}: cannot read its data: {exc}") from exc
    if not len(data):
        raise ClientUnavailable(f"site {site}: no {split} rows in {manifest_csv}")
    _DATA[key] = data
    return data


def site_model(cfg_json: str, method_name: str, seed: int, encoder_dir: str, threads: int) -> tuple[Method, FedHistoModel]:
    torch.set_num_threads(max(threads, 1))
    key = (hashlib.sha256(cfg_json.encode()).hexdigest(), method_name, seed, encoder_dir)
    if key not in _MODELS:
        cfg = config_from_json(cfg_json)
        method = build_method(method_name, cfg)
        _MODELS[key] = (method, build_model(cfg, method, seed, encoder_dir or None).to(pick_device()))
    return _MODELS[key]


class Site:
    """One site in one run: method, model, its optimisation data and stain descriptors."""

    def __init__(self, sc: SiteConfig, cfg_json: str, method_name: str, seed: int) -> None:
        self.sc, self.seed = sc, seed
        self.method, self.model = site_model(cfg_json, method_name, seed, sc.encoder_dir, sc.threads)
        self.cfg = self.method.cfg
        self.device = pick_device()
        doc = json.loads(Path(sc.descriptors).read_text()) if self.method.film else None
        self.descriptors = self.method.descriptors(doc, [sc.site])  # this site's and the centroid ("global")

    @property
    def data(self) -> Split:
        return load_site_split(self.sc.manifest, self.sc.site, "optimisation", self.cfg.views.crop_size)

    def identity(self) -> dict:
        """What the server checks against the run identity (no data, no path)."""
        return {"descriptor": self.descriptors[self.sc.site], "encoder_digest": encoder_digest(self.cfg, self.sc.encoder_dir or None)}

    # ------------------------------------------------------------ method hooks
    def upload_before_training(self, start_state: dict[str, torch.Tensor], round_idx: int, k: int):
        from fedhisto.methods.base import named_rng

        return self.method.upload_before_training(self.model, start_state, self.data,
                                                  named_rng("style_sample", self.seed, round_idx, k), self.device)

    def train(self, start_state: dict[str, torch.Tensor], payload: dict, round_idx: int, k: int) -> LocalResult:
        return local_train(self.method, self.model, start_state, self.data, self.descriptors[self.sc.site], payload,
                           self.cfg, self.seed, round_idx, k, self.device)

    def upload_after_aggregation(self, state: dict[str, torch.Tensor]):
        self.model.load_trainable_state(state)
        return self.method.upload_after_aggregation(self.model, self.data, self.descriptors[self.sc.site], self.device)

    # ------------------------------------------------------------ evaluation site
    def validation(self) -> Split:
        return load_site_split(self.sc.manifest, None, "validation", self.cfg.views.crop_size)

    def validate(self, members: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
        """``train.participants.validate_members`` on the validation split, with the centroid descriptor."""
        return validate_members(self.model, self.validation(), self.descriptors[GLOBAL], self.cfg, self.device, members)

    def predict_validation(self, members: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        val = self.validation()
        out = {}
        for name, state in members.items():
            self.model.load_trainable_state(state)
            out[name] = predict(self.model, val, self.descriptors[GLOBAL], self.cfg, self.device)
        return out

