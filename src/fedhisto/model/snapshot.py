"""A hub encoder's weights as a local snapshot: fetched once where the hub is reachable, read by every job.

Compute nodes of a cluster often reach no network, and a job that downloads in its first minutes fails there
(or, with retries, three times). So jobs never download: ``local_snapshot`` finds the pinned revision in the
Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``, which a cluster puts on the shared file system) with
``local_files_only`` (``model.encoder.local_snapshot``), and a job without it stops naming the command to
run. ``fedhisto fetch-encoder``
(``fetch_encoder``) is that command: on a login node, once, it downloads the configuration's pinned revision
into the cache (or into ``--dir``, then named in ``model.encoder.local_dir``) and loads it strictly into the
encoder's architecture, so a wrong or partial snapshot is found there and not in a queued job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def fetch_encoder(cfg: Any, dest: str | Path | None = None) -> dict:
    """Download the configuration's pinned encoder revision (into the cache, or ``dest``) and load it
    strictly. Returns what was fetched, its folder and the digest runs will record."""
    from fedhisto.infra.provenance import digest_path
    from fedhisto.model.encoder import HUB_FILES, load_encoder_folder
    from fedhisto.model.encoder_families import EncoderLoadError
    from fedhisto.registries.encoder_registry import encoder_entry

    enc = cfg.model.encoder
    entry = encoder_entry(enc.name)
    if enc.local_dir:
        folder = Path(enc.local_dir)
        load_encoder_folder(folder, enc.name)
        return {"encoder": enc.name, "folder": str(folder), "downloaded": False, "digest": digest_path(folder),
                "note": "model.encoder.local_dir is set: nothing to download, the folder loads"}
    if entry.hub_id is None:
        raise EncoderLoadError(f"encoder {enc.name!r} has no hub repository ({entry.revision_note}): nothing to fetch")
    if enc.revision is None:
        raise EncoderLoadError(f"encoder {enc.name!r}: no revision of {enc.repo_id} is pinned; set "
                               f"model.encoder.revision first. {entry.get_started()}")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id=enc.repo_id, revision=enc.revision, allow_patterns=HUB_FILES,
                                        local_dir=str(dest) if dest else None))
    except Exception as exc:  # network, authentication (a gated model), a revision the hub does not have
        raise EncoderLoadError(f"cannot fetch {enc.repo_id}@{enc.revision}: {type(exc).__name__}: {exc}; "
                               f"{entry.get_started()}") from exc
    load_encoder_folder(folder, enc.name)
    out = {"encoder": enc.name, "repo_id": enc.repo_id, "revision": enc.revision, "folder": str(folder),
           "downloaded": True, "digest": digest_path(folder)}
    if dest:
        out["note"] = f"set model.encoder.local_dir: {folder}"
    return out


def _cmd_fetch_encoder(args: argparse.Namespace) -> int:
    from fedhisto.config.study import command_line_config, load_config

    # the config's model block is all it reads: the typed config, without the run checks of fedhisto.entry
    print(json.dumps(fetch_encoder(load_config(command_line_config([args.config])), args.dir), indent=2))
    return 0


def fetch_parsers(sub: Any) -> None:
    p = sub.add_parser("fetch-encoder", help="download the configuration's pinned hub encoder once (a login node), "
                                             "for jobs that never download")
    p.add_argument("--config", default="config/config.yaml", help="model.encoder: name, repo_id, revision")
    p.add_argument("--dir", default=None, help="into this folder (then set model.encoder.local_dir) instead of the "
                                               "Hugging Face cache")
    p.set_defaults(func=_cmd_fetch_encoder)
