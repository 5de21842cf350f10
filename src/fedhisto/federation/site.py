"""A site's half of a federated round, without Flower: its data, its model, its method hooks.

The ClientApp (``client_app``) decodes messages into these calls and encodes the results; nothing
here imports flwr. A site reads only its own rows of a manifest (``client == site`` and split
``optimisation``; the evaluation site also its ``validation`` rows), in the same order and with the
same decoding as ``train.data.load_partitions``, so that a site's ``local_train`` is bitwise the
in-process engine's.

Models, the frozen encoder and decoded data are cached per process (``_MODELS``/``_ENCODERS``/
``_DATA``): a long-lived process (the opt-in long-lived site worker, or a Simulation Engine Ray
actor) loads the encoder once per node and decodes the site's images once. Decoded images are
also cached on the node's disk (node config ``cache-dir``), keyed by the SHA-256 of the manifest
file, the site, the split and the decode size: a manifest that changes (any row, any image digest)
is a new key and is decoded again, and a cache file whose recorded key differs is never used. The
cache files are safetensors (arrays and JSON text), read as data: nothing in them can run code.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedhisto import CLASSES
from fedhisto.config.study import Config, load_config
from fedhisto.data.splits import Split, _load
from fedhisto.infra.atomic import atomic_path
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL
from fedhisto.methods.strategy import Strategy
from fedhisto.model.build import build_model, encoder_digest, pick_device
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.inference import predict
from fedhisto.train.local import LocalResult, local_train
from fedhisto.train.loop import ClientUnavailable
from fedhisto.train.participants import validate_members

log = logging.getLogger(__name__)
_MODELS: dict[tuple, tuple[Strategy, FedHistoModel]] = {}
_ENCODERS: dict[tuple, object] = {}  # (encoder config, folder digest) -> FrozenEncoder, before LoRA
_DATA: dict[tuple, Split] = {}
DATA_CACHE_FORMAT = 2  # 2: safetensors (1 was a pickle)
# what this process has built or decoded itself (not read from a cache): every reply's ``info`` carries
# it, so a run shows which messages paid for a build (a warmed worker's messages: none)
BUILT = {"encoders_built": 0, "models_built": 0, "images_decoded": 0}


@dataclass
class SiteConfig:
    """One site, as its SuperNode's node config names it (``site-id``, ``manifest``, ``descriptors``,
    optional ``encoder-dir``, ``threads`` and ``cache-dir``)."""

    site: str
    manifest: str
    descriptors: str = ""
    encoder_dir: str = ""
    threads: int = 1
    cache_dir: str = ""
    report: str = "rows"  # federated evaluation: "rows" (per image) or "counts" (this site's opt-out of rows)

    @classmethod
    def from_node_config(cls, node_config: dict, run_config: dict) -> SiteConfig:
        """Deployment: the SuperNode's ``--node-config``. Simulation (virtual nodes only get a
        ``partition-id``): partition k is the k-th site of the run config's sorted ``sites``, reading
        the run config's ``sim-manifest``/``sim-descriptors``."""
        if "site-id" in node_config:
            return cls(str(node_config["site-id"]), str(node_config.get("manifest", "")),
                       str(node_config.get("descriptors", "")), str(node_config.get("encoder-dir", "")),
                       int(node_config.get("threads", 1)), str(node_config.get("cache-dir", "")),
                       str(node_config.get("report", "rows")))
        sites = sorted(s.strip() for s in str(run_config["sites"]).split(",") if s.strip())
        return cls(sites[int(node_config["partition-id"])], str(run_config.get("sim-manifest", "")),
                   str(run_config.get("sim-descriptors", "")), str(run_config.get("encoder-dir", "")),
                   int(run_config.get("threads", 1)))


def config_from_json(text: str) -> Config:
    return load_config(json.loads(text))


def federated_config(cfg: Config) -> Config:
    """The config a federated run sends its sites (``run.config``, as JSON): every site trains alone,
    so the engine is the sequential one whatever ``train.engine`` says (the run identity says so too)."""
    if cfg.train.engine == "sequential":
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"engine": "sequential"})})


def warm_up(sc: SiteConfig, cfg: Config, splits: tuple[str, ...] = ("optimisation",),
            runs: tuple[tuple[str, int], ...] = ()) -> dict:
    """What a long-lived site worker loads before it says ready, once per deployment, into the same
    per-process caches a message fills: the frozen encoder (from the node's encoder file when there
    is one), the site's decoded images of ``splits`` (``optimisation`` and ``holdout``: its own rows;
    ``validation``, ``test``, ``external``: every row of the split in its manifest, as an evaluation
    site reads them) and, per ``(method, seed)`` of ``runs``, the model for ``cfg`` as the ServerApp
    sends it (``federated_config``). A message whose run differs finds no model under its key and
    builds its own; encoder and images are keyed on what they depend on only. Nothing here is needed
    for a correct reply: a part that fails (an undecodable image, a split the manifest lacks) is
    logged and left to the first message, which reports it through the message path by site.
    Returns the seconds of each part (or why it failed)."""
    import time

    cfg = federated_config(cfg)
    done: dict[str, object] = {}

    def part(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            done[name] = round(time.perf_counter() - t0, 3)
        except Exception as exc:
            log.warning("site %s: warm-up of %s failed (%s: %s); the first message that needs it retries",
                        sc.site, name, type(exc).__name__, exc)
            done[name] = f"failed: {type(exc).__name__}"

    torch.set_num_threads(max(sc.threads, 1))
    part("encoder", lambda: frozen_encoder(cfg, sc.encoder_dir, sc.cache_dir))
    for split in splits:
        who = sc.site if split in ("optimisation", "holdout") else None
        part(f"images:{split}", lambda s=split, w=who: load_site_split(sc.manifest, w, s, cfg.views.crop_size,
                                                                          sc.cache_dir))
    cfg_json = cfg.model_dump_json()
    for method, seed in runs:
        part(f"model:{method}:{seed}", lambda m=method, s=seed: site_model(cfg_json, m, int(s), sc.encoder_dir,
                                                                           sc.threads, sc.cache_dir))
    return done


def load_site_split(manifest_csv: str, site: str | None, split: str, crop_size: int, cache_dir: str = "") -> Split:
    """``site``'s rows of one split (``site=None``: all rows of the split), as ``load_partitions``.
    With ``cache_dir`` the decoded images come from (or go to) the node-local cache (module docstring)."""
    key = (str(Path(manifest_csv).resolve()), site, split, crop_size)
    if key in _DATA:
        return _DATA[key]
    try:
        text = Path(manifest_csv).read_bytes()
        cache = _cache_file(cache_dir, text, site, split, crop_size) if cache_dir else None
        data = _read_cache(cache) if cache else None
        if data is None:
            rows = [r for r in csv.DictReader(io.StringIO(text.decode()))
                    if r["split"] == split and (site is None or r["client"] == site)]
            rows.sort(key=lambda r: r["sample_id"])
            data = Split([r["sample_id"] for r in rows], [CLASSES.index(r["label"]) for r in rows],
                         [_decode(r, site, crop_size) for r in rows])
            if cache and len(data):
                _write_cache(cache, data)
    except OSError as exc:  # the site's data cannot be read: declared unavailability
        raise ClientUnavailable(f"site {site}: cannot read its data: {exc}") from exc
    if not len(data):
        raise ClientUnavailable(f"site {site}: no {split} rows in {manifest_csv}")
    _DATA[key] = data
    return data


def _decode(row: dict, site: str | None, crop_size: int) -> object:
    """One image; a failure names the sample id to the coordinator and the file only in the site's log
    (a reply never carries a site's paths)."""
    try:
        image = _load(row["path"], 2 * crop_size)
        BUILT["images_decoded"] += 1
        return image
    except OSError as exc:
        log.error("site %s: image %s (%s) cannot be decoded: %s", site, row["sample_id"], row["path"], exc)
        raise ClientUnavailable(f"site {site}: image {row['sample_id']} cannot be decoded "
                                f"({type(exc).__name__}; the file is named in the site's log)") from None


def _cache_file(cache_dir: str, manifest_bytes: bytes, site: str | None, split: str, crop_size: int) -> tuple[Path, str]:
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    key = hashlib.sha256(json.dumps([DATA_CACHE_FORMAT, digest, site, split, 2 * crop_size]).encode()).hexdigest()
    return Path(cache_dir) / f"decoded-{site or 'all'}-{split}-{key[:20]}.safetensors", key


def _read_cache(cache: tuple[Path, str]) -> Split | None:
    """The cached images: a safetensors file (arrays, and JSON text for the key, ids and labels), so a file
    put in the cache folder by anyone is read as data and never runs code."""
    from safetensors import safe_open

    path, key = cache
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
            if meta.get("key") != key:
                log.warning("decoded-image cache %s belongs to another manifest: decoding again", path)
                return None
            ids, labels = json.loads(meta["ids"]), json.loads(meta["labels"])
            images = [fh.get_tensor(f"image{i}") for i in range(len(ids))]
    except Exception as exc:  # a truncated or foreign file: decode again and overwrite it
        log.warning("decoded-image cache %s unreadable (%s): decoding again", path, exc)
        return None
    return Split(ids, labels, images)


def _write_cache(cache: tuple[Path, str], data: Split) -> None:
    from safetensors.numpy import save_file

    path, key = cache
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"image{i}": np.ascontiguousarray(img) for i, img in enumerate(data.images)}
    meta = {"key": key, "ids": json.dumps(list(data.ids)), "labels": json.dumps([int(y) for y in data.labels])}
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata=meta)


def frozen_encoder(cfg: Config, encoder_dir: str, cache_dir: str = ""):
    """A private copy of this node's frozen encoder, loaded once per process (LoRA is injected into
    the copy by ``FedHistoModel``); with ``cache_dir`` from the node's encoder file, written on the
    first build (``federation.encoder_cache``), so a restarted worker does not rebuild it."""
    from fedhisto.model.encoder import load_encoder

    key = (cfg.model.encoder.model_dump_json(), encoder_digest(cfg, encoder_dir or None))
    if key not in _ENCODERS:
        def build():
            torch.manual_seed(0)  # as build_model: a random (non-pretrained) encoder is the same everywhere
            BUILT["encoders_built"] += 1
            return load_encoder(cfg.model.encoder, encoder_dir or None)

        if cache_dir:
            from fedhisto.federation.encoder_cache import cached_encoder

            _ENCODERS[key] = cached_encoder(cache_dir, cfg, encoder_dir, build)
        else:
            _ENCODERS[key] = build()
    return copy.deepcopy(_ENCODERS[key])


def site_model(cfg_json: str, method_name: str, seed: int, encoder_dir: str, threads: int,
               cache_dir: str = "") -> tuple[Strategy, FedHistoModel]:
    torch.set_num_threads(max(threads, 1))
    key = (hashlib.sha256(cfg_json.encode()).hexdigest(), method_name, seed, encoder_dir)
    if key not in _MODELS:
        cfg = config_from_json(cfg_json)
        method = build_method(method_name, cfg)
        model = build_model(cfg, method, seed, encoder_dir or None, encoder=frozen_encoder(cfg, encoder_dir, cache_dir))
        _MODELS[key] = (method, model.to(pick_device(cfg)))
        BUILT["models_built"] += 1
    return _MODELS[key]


class Site:
    """One site in one run: method, model, its optimisation data and stain descriptors."""

    def __init__(self, sc: SiteConfig, cfg_json: str, method_name: str, seed: int) -> None:
        self.sc, self.seed = sc, seed
        self.method, self.model = site_model(cfg_json, method_name, seed, sc.encoder_dir, sc.threads, sc.cache_dir)
        self.cfg = self.method.cfg
        self.device = pick_device(self.cfg)
        doc = json.loads(Path(sc.descriptors).read_text()) if self.method.film else None
        try:
            self.descriptors = self.method.descriptors(doc, [sc.site])  # this site's and the centroid ("global")
        except KeyError:  # an evaluation-only site (test / external set): the centroid only
            self.descriptors = {**self.method.descriptors(doc, []), sc.site: None}

    @property
    def data(self) -> Split:
        return load_site_split(self.sc.manifest, self.sc.site, "optimisation", self.cfg.views.crop_size,
                               self.sc.cache_dir)

    def identity(self) -> dict:
        """What the server checks against the run identity (no data, no path)."""
        return {"descriptor": self.descriptors[self.sc.site], "encoder_digest": encoder_digest(self.cfg, self.sc.encoder_dir or None)}

    # ------------------------------------------------------------ method hooks
    def upload_before_training(self, start_state: dict[str, torch.Tensor], round_idx: int, k: int):
        from fedhisto.methods.base import named_rng

        return self.method.objective.upload_before_training(self.model, start_state, self.data,
                                                            named_rng("style_sample", self.seed, round_idx, k),
                                                            self.device)

    def train(self, start_state: dict[str, torch.Tensor], payload: dict, round_idx: int, k: int) -> LocalResult:
        return local_train(self.method.objective, self.model, start_state, self.data, self.descriptors[self.sc.site],
                           payload, self.cfg, self.seed, round_idx, k, self.device)

    # ------------------------------------------------ under secure aggregation
    kept_state = None  # the run's Context.state (set per message by handlers.handle)

    def keep_for_masking(self, start: dict[str, torch.Tensor], result: LocalResult, round_idx: int) -> list:
        """Keep what this site masks this round (``secure_site.keep``): its terms with its losses, and for
        statistics weights its update; the layout of the terms goes back in the clear."""
        from fedhisto.federation.secure_site import keep
        from fedhisto.train.secure_round import client_terms

        scaling = self.model.lora_scaling
        terms = client_terms(self.method, result.state, start, scaling, result.losses)
        if self.method.secure_aggregation().weights == "statistics":
            keep(self.kept_state, "statistic", round_idx, self.method.objective.secure_statistic(result.state, start, scaling))
        return keep(self.kept_state, "terms", round_idx, terms)

    def keep_post_for_masking(self, upload, round_idx: int) -> list:
        from fedhisto.federation.secure_site import keep

        return keep(self.kept_state, "post", round_idx, self.method.objective.secure_post_terms(upload))

    def upload_after_aggregation(self, state: dict[str, torch.Tensor]):
        self.model.load_trainable_state(state)
        return self.method.objective.upload_after_aggregation(self.model, self.data, self.descriptors[self.sc.site],
                                                              self.device)

    # ------------------------------------------------------------ evaluation site
    def validation(self) -> Split:
        return load_site_split(self.sc.manifest, None, "validation", self.cfg.views.crop_size, self.sc.cache_dir)

    @property
    def report(self) -> str:
        if self.sc.report not in ("rows", "counts"):
            raise ValueError(f"site {self.sc.site}: node config report={self.sc.report!r} is not rows or counts")
        return self.sc.report

    def evaluation_split(self, split: str) -> tuple[Split, list[dict]]:
        """One split this site holds (``holdout``: its own rows; others: every row of the split in its
        manifest), and each image's client / differentiation / magnification from the manifest."""
        from fedhisto.federation.evaluate import read_manifest_meta

        who = self.sc.site if split == "holdout" else None
        data = load_site_split(self.sc.manifest, who, split, self.cfg.views.crop_size, self.sc.cache_dir)
        meta = read_manifest_meta(self.sc.manifest, who, split)
        return data, [meta[i] for i in data.ids]

    def validation_counts(self, members: dict[str, dict[str, torch.Tensor]]) -> dict[str, list]:
        """The confusion matrix of every member on this site's validation rows (early stopping over
        validation held by several sites sums them)."""
        import numpy as np

        from fedhisto.stats.scores import confusion

        val = self.validation()
        out = {}
        for name, state in members.items():
            self.model.load_trainable_state(state)
            pred = predict(self.model, val, self.descriptors[GLOBAL], self.cfg, self.device).argmax(1).numpy()
            out[name] = confusion(np.asarray(val.labels, dtype=int), pred).tolist()
        return out

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

