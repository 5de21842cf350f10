"""A hub encoder's weights as a local snapshot: fetched once where the hub is reachable, read by every job.

Compute nodes of a cluster often reach no network, and a job that downloads in its first minutes fails there
(or, with retries, three times). So jobs never download: ``local_snapshot`` finds the pinned revision in the
Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``, which a cluster puts on the shared file system) with
``local_files_only``, and a job without it stops naming the command to run. ``fedhisto fetch-encoder``
(``fetch_encoder``) is that command: on a login node, once, it downloads the configuration's pinned revision
into the cache (or into ``--dir``, then named in ``model.encoder.local_dir``) and loads it strictly into the
encoder's architecture, so a wrong or partial snapshot is found there and not in a queued job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: what a snapshot needs: the config and the weights (either format)
HUB_FILES = ["*.json", "*.safetensors", "*.bin"]


def fetch_command(config: str | None) -> str:
    return f"fedhisto fetch-encoder --config {config or '<your config>'}"


def local_snapshot(entry: Any, repo_id: str, revision: str | None, config: str | None = None) -> Path:
    """The pinned revision's snapshot in the local Hugging Face cache; never downloads."""
    from fedhisto.model.encoder_families import EncoderLoadError

    if revision is None:
        raise EncoderLoadError(f"encoder {entry.name!r}: no revision of {repo_id} is pinned ({entry.revision_note}); "
                               f"{entry.get_started()}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_FILES,
                                      local_files_only=True))
    except Exception as exc:  # not in the cache (or a partial one): say what to run, and where
        from huggingface_hub.constants import HF_HUB_CACHE

        raise EncoderLoadError(
            f"encoder {entry.name!r}: no local snapshot of {repo_id}@{revision} in the Hugging Face cache "
            f"{HF_HUB_CACHE} ({type(exc).__name__}). Jobs never download: run `{fetch_command(config)}` once "
            "where the hub is reachable (a login node), with the same HF_HOME as the jobs, or set "
            "model.encoder.local_dir to a downloaded snapshot") from None


def fetch_encoder(cfg: Any, dest: str | Path | None = None) -> dict:
    """Download the configuration's pinned encoder revision (into the cache, or ``dest``) and load it
    strictly. Returns what was fetched, its folder and the digest runs will record."""
    from fedhisto.infra.provenance import digest_path
    from fedhisto.model.encoder import load_encoder_folder
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
    from fedhisto.entry import study_config_file

    print(json.dumps(fetch_encoder(study_config_file(args.config), args.dir), indent=2))
    return 0


def fetch_parsers(sub: Any) -> None:
    p = sub.add_parser("fetch-encoder", help="download the configuration's pinned hub encoder once (a login node), "
                                             "for jobs that never download")
    p.add_argument("--config", default="config/config.yaml", help="model.encoder: name, repo_id, revision")
    p.add_argument("--dir", default=None, help="into this folder (then set model.encoder.local_dir) instead of the "
                                               "Hugging Face cache")
    p.set_defaults(func=_cmd_fetch_encoder)
