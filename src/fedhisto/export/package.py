"""The portable model package: its layout, written and read here only.

::

    PKG/
      package.json              classes, encoder, normalisation, descriptor statistics, temperature,
                                members (run identities), code version, model settings
      SHA256SUMS                SHA-256 of every other file (``sha256sum -c`` format), verified on load
      model_card.md, model_card.json
      encoder/                  only for an encoder no hub holds (the pipeline-pretrained tiny one)
      members/seed<S>/lora/adapter_config.json, adapter_model.safetensors
                                peft's own adapter format: ``PeftModel.from_pretrained(encoder, this)``
      members/seed<S>/head.safetensors
                                residual adapter, FiLM and classifier (the rest of the trainable state)
      members/seed<S>/domain.safetensors
                                the member's domain statistics (class means and counts of the training
                                sites' adapted embeddings, their shared covariance; fedhisto.export.domain_stats)
      members/seed<S>/folded_base.safetensors
                                only for a method that folds into the frozen weights (FedEx-LoRA): the
                                dense offset of each adapted module's frozen weight, under the model's
                                name of that weight (``encoder.<module>.base_layer.weight``); the model is
                                (W0 + offset) x + s B A x, so add it to the encoder before the adapters

Nothing is a pickle: tensors are safetensors, everything else JSON or text. A package is written into
a temporary sibling folder and renamed into place, so it is complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhisto.infra.atomic import write_json, write_text
from fedhisto.infra.provenance import digest_path, sha256_file

FORMAT = "fedhisto-model-package/1"
CHECKSUMS = "SHA256SUMS"
LORA_MARK = ".lora_"
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's adapter name inside the live model (inject_adapter_in_model)
#: file kinds a package may hold; a pickle (.pt/.pkl/.bin/.pth) is never one of them
ALLOWED_SUFFIXES = (".json", ".safetensors", ".md", ".txt", "")
#: files a tool adds beside the package that are not part of it: Snakemake's marker of a directory output
FOREIGN = (".snakemake_timestamp",)


class PackageError(RuntimeError):
    """A package that is incomplete, corrupted, or does not fit what it is loaded with."""


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(LoRA tensors in peft's saved-adapter names, the rest under the model's own names).

    The live model's LoRA tensors are ``encoder.<module>.lora_A.default.weight`` (LoRA injected into the
    encoder module with adapter name ``default``); peft saves them as
    ``base_model.model.<module>.lora_A.weight``, the names ``PeftModel.from_pretrained`` reads."""
    lora, rest = {}, {}
    for name, tensor in state.items():
        if LORA_MARK in name:
            if not name.startswith("encoder.") or f".{ADAPTER}." not in name:
                raise PackageError(f"LoRA tensor {name!r} is not under encoder.* with adapter {ADAPTER!r}")
            peft_name = PEFT_PREFIX + name.removeprefix("encoder.").replace(f".{ADAPTER}.", ".")
            lora[peft_name] = tensor.detach().contiguous().cpu()
        else:
            rest[name] = tensor.detach().contiguous().cpu()
    return lora, rest


def join_state(lora: dict[str, torch.Tensor], rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_state`: the live model's trainable state."""
    out = dict(rest)
    for name, tensor in lora.items():
        if not name.startswith(PEFT_PREFIX):
            raise PackageError(f"adapter tensor {name!r} is not under {PEFT_PREFIX!r}")
        module, _, leaf = name.removeprefix(PEFT_PREFIX).rpartition(".")  # leaf: weight
        out[f"encoder.{module}.{ADAPTER}.{leaf}"] = tensor
    return out


def adapter_config(model_block: dict, target_modules: list[str], base: str) -> dict:
    """peft's ``adapter_config.json`` for the run's LoRA (the LoraConfig the model was built with)."""
    from peft import LoraConfig

    cfg = LoraConfig(r=model_block["lora_r"], lora_alpha=model_block["lora_alpha"],
                     lora_dropout=model_block["lora_dropout"], target_modules=sorted(target_modules), bias="none",
                     base_model_name_or_path=base)
    doc = cfg.to_dict()
    doc["target_modules"] = sorted(doc["target_modules"])  # a set in peft: fixed order, stable checksums
    return json.loads(json.dumps(doc, default=str))


FOLDED_FILE = "folded_base.safetensors"
DOMAIN_FILE = "domain.safetensors"


def write_member(folder: Path, state: dict[str, torch.Tensor], lora_config: dict) -> None:
    from safetensors.torch import save_file

    from fedhisto.fedmath.lora_aggregators.fold import split_folded

    state, folded = split_folded(state)
    lora, rest = split_state(state)
    (folder / "lora").mkdir(parents=True, exist_ok=True)
    save_file(lora, str(folder / "lora/adapter_model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "lora/adapter_config.json", lora_config)
    save_file(rest, str(folder / "head.safetensors"), metadata={"format": "pt"})
    if folded:
        save_file({k: t.detach().contiguous().cpu() for k, t in folded.items()}, str(folder / FOLDED_FILE),
                  metadata={"format": "pt"})


def read_member(folder: Path) -> dict[str, torch.Tensor]:
    """The member state as the live model loads it (its folded base deltas too, where the member has them)."""
    from safetensors.torch import load_file

    from fedhisto.fedmath.lora_aggregators.fold import FOLDED

    state = join_state(load_file(str(folder / "lora/adapter_model.safetensors")),
                       load_file(str(folder / "head.safetensors")))
    if (folder / FOLDED_FILE).exists():
        state.update({FOLDED + k: t for k, t in load_file(str(folder / FOLDED_FILE)).items()})
    return state


def write_checksums(root: Path) -> None:
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}"
             for p in sorted(q for q in root.rglob("*") if q.is_file() and q.name != CHECKSUMS)]
    write_text(root / CHECKSUMS, "\n".join(lines) + "\n")


def verify_checksums(root: Path) -> None:
    """Every file listed, present and unchanged; no file unlisted; no pickle."""
    path = root / CHECKSUMS
    if not path.exists():
        raise PackageError(f"{root}: no {CHECKSUMS}; not a model package (or an incomplete one)")
    listed = {}
    for line in path.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        listed[rel] = digest
    present = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and p.name != CHECKSUMS and p.relative_to(root).as_posix() not in FOREIGN}
    if missing := sorted(set(listed) - present):
        raise PackageError(f"{root}: file(s) listed in {CHECKSUMS} are missing: {missing[:5]}")
    if extra := sorted(present - set(listed)):
        raise PackageError(f"{root}: file(s) not in {CHECKSUMS} (added after export?): {extra[:5]}")
    for rel, digest in sorted(listed.items()):
        if sha256_file(root / rel) != digest:
            raise PackageError(f"{root / rel}: SHA-256 differs from {CHECKSUMS} (corrupted or modified file); "
                               "export the package again")
    check_no_pickle(root)


def check_no_pickle(root: Path) -> None:
    bad = [p.relative_to(root).as_posix() for p in root.rglob("*")
           if p.is_file() and p.suffix.lower() not in ALLOWED_SUFFIXES]
    if bad:
        raise PackageError(f"{root}: files of a kind a package never holds (a pickle?): {bad[:5]}")


def write_package(out: Path, meta: dict, members: dict[str, dict[str, torch.Tensor]], lora_config: dict,
                  card: tuple[str, dict], encoder_folder: Path | None, overwrite: bool = False,
                  domain: dict[str, dict] | None = None) -> Path:
    """Write the whole package into a temporary sibling and rename it onto ``out``. ``domain``: per member,
    the numpy arrays of its ``domain.safetensors``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise PackageError(f"{out}: exists and is not empty; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, state in members.items():
            write_member(tmp / "members" / name, state, lora_config)
            if domain and name in domain:
                from safetensors.numpy import save_file

                save_file({k: np.ascontiguousarray(v) for k, v in domain[name].items()},
                          str(tmp / "members" / name / DOMAIN_FILE), metadata={"format": "np"})
        if encoder_folder is not None:
            shutil.copytree(encoder_folder, tmp / "encoder")
            meta = {**meta, "encoder": {**meta["encoder"], "included": "encoder/",
                                        "folder_digest": digest_path(tmp / "encoder")}}
        write_json(tmp / "package.json", meta)
        write_text(tmp / "model_card.md", card[0])
        write_json(tmp / "model_card.json", card[1])
        check_no_pickle(tmp)
        write_checksums(tmp)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass
class Package:
    root: Path
    meta: dict[str, Any]
    members: dict[str, dict[str, torch.Tensor]]
    domain: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # member -> its domain statistics

    @property
    def encoder_name(self) -> str:
        return self.meta["encoder"]["name"]


def load_package(root: str | Path, expect_encoder: str | None = None) -> Package:
    """Verify checksums, then read the metadata and every member's state (tensors only)."""
    root = Path(root)
    if not (root / "package.json").exists():
        raise PackageError(f"{root}: no package.json; not a model package (made by `fedhisto export`)")
    verify_checksums(root)
    meta = json.loads((root / "package.json").read_text())
    if meta.get("format") != FORMAT:
        raise PackageError(f"{root}: package format {meta.get('format')!r}, this fedhisto reads {FORMAT!r}")
    if expect_encoder is not None and meta["encoder"]["name"] != expect_encoder:
        raise PackageError(f"{root}: the package was trained on encoder {meta['encoder']['name']!r}, "
                           f"not {expect_encoder!r}; it cannot be used with {expect_encoder!r}")
    members = {m["name"]: read_member(root / "members" / m["name"]) for m in meta["members"]}
    for name, state in members.items():
        bad = [k for k, t in state.items() if not torch.isfinite(t).all()]
        if bad:
            raise PackageError(f"{root}/members/{name}: non-finite tensors {bad[:3]}")
    return Package(root, meta, members, read_domain(root, [m["name"] for m in meta["members"]]))


def read_domain(root: Path, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Each member's domain statistics; empty for a package exported before they existed."""
    from safetensors.numpy import load_file

    out = {}
    for name in names:
        path = root / "members" / name / DOMAIN_FILE
        if path.exists():
            out[name] = load_file(str(path))
            if not all(np.isfinite(v).all() for k, v in out[name].items() if k != "class_means"):
                raise PackageError(f"{path}: non-finite domain statistics")
    return out
