"""Stage experiments: results/experiments/<name>/ (designs in docs/experiments.md).

One entry script for the stage's rules; each rule calls one library function. Standalone:
``snakemake results/experiments/<name>/<name>.json`` (the experiments need the main pipeline's artifacts).

Every rule but two (rendering the shifted cohort, which forks a process pool, and building a condition's
manifest, which needs no torch) hands its function to the warm server (``fedhisto.infra.warm_server.call``), as the
main stages' scripts do: an experiments run is mostly short torch jobs (a sensitivity run alone has 94),
each of which otherwise spent its first seconds importing torch, transformers and peft. The functions
and arguments are those of a cold job; only the process that runs them differs.
"""

from pathlib import Path

from fedhisto.entry import from_snakemake, log_of
from fedhisto.infra.warm_server import call


def warm(target: str, *args, **kwargs):
    return call(target, *args, log_path=log_of(smk), **kwargs)


def encoder_dir() -> str | None:
    """The rule's pretrained encoder folder, when it has one as input."""
    return smk.input.encoder[0] if smk.input.get("encoder") else None


if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    rule = smk.rule
    if rule == "render_shifted_cohort":
        from fedhisto.experiments.severity_render import run_render_shift

        run_render_shift(cfg, Path(smk.output.cohort).parent, threads=smk.threads)
    elif rule == "pretrain_plain_encoder":
        from fedhisto.experiments.layout import plain_encoder_config

        warm("fedhisto.pretrain.stage:run_pretrain", plain_encoder_config(cfg), smk.output.encoder, threads=smk.threads,
             manifest_csv=smk.input.get("manifest"))
    elif rule == "build_condition_manifest":
        from fedhisto.experiments.conditions import leave_one_site_out_manifest, policy_manifest

        kind, name = smk.wildcards.condition.split("/")
        out = Path(smk.output.manifest).parent
        if kind == "leakage":
            policy_manifest(smk.input.sources, smk.input.families, smk.input.edges, cfg, name, out)
        else:
            leave_one_site_out_manifest(smk.input.manifest, smk.input.identity, name, cfg, out)
    elif rule == "train_encoder_condition":
        from fedhisto.experiments.layout import condition_config

        warm("fedhisto.train.stage:run_train", smk.wildcards.method, int(smk.wildcards.seed), smk.input.manifest,
             smk.input.identity, smk.input.descriptors, condition_config(cfg, f"dose_response/{smk.wildcards.label}"),
             Path(smk.output.status).parent, encoder_dir=None, threads=smk.threads)
    elif rule == "predict_shifted_cohort":
        from fedhisto.experiments.layout import condition_config

        warm("fedhisto.experiments.shifted:predict_shifted", smk.wildcards.method, int(smk.wildcards.seed),
             Path(smk.input.status).parent, smk.input.manifest, smk.input.identity, smk.input.descriptors,
             smk.input.cohort, condition_config(cfg, f"dose_response/{smk.wildcards.encoder}"),
             smk.output.predictions, encoder_dir=encoder_dir(),
             threads=smk.threads)
    elif rule == "summarize_dose_response":
        warm("fedhisto.experiments.dose_response:summarise_dose_response", [tuple(r) for r in smk.params.runs],
             smk.input.cohort, cfg, Path(smk.output.json).parent)
    elif rule == "summarize_leakage":
        warm("fedhisto.experiments.leakage:summarise_leakage", [tuple(r) for r in smk.params.runs],
             dict(smk.params.manifests), cfg, Path(smk.output.json).parent)
    elif rule == "summarize_leave_one_site_out":
        warm("fedhisto.experiments.leave_one_site_out:summarise_leave_one_site_out",
             [tuple(r) for r in smk.params.runs], cfg, Path(smk.output.json).parent)
    elif rule == "calibrate_checkpoints":
        warm("fedhisto.experiments.calibration:summarise_calibration", [tuple(r) for r in smk.params.runs], cfg,
             Path(smk.output.json).parent)
    elif rule == "probe_encoder":
        warm("fedhisto.experiments.probe:probe_condition", cfg, smk.wildcards.encoder, smk.input.cohort,
             Path(smk.output.json).parent, encoder_dir=encoder_dir(),
             threads=smk.threads)
    elif rule == "summarize_probe":
        warm("fedhisto.experiments.probe:summarise_probe", dict(smk.params.probes), smk.input.dose_response, cfg,
             Path(smk.output.json).parent)
    elif rule == "train_sensitivity":
        from fedhisto.experiments.sensitivity_layout import reading_config

        warm("fedhisto.train.stage:run_train", smk.wildcards.method, int(smk.wildcards.seed), smk.input.manifest,
             smk.input.identity, smk.input.descriptors, reading_config(cfg, smk.wildcards.reading),
             Path(smk.output.status).parent, encoder_dir=encoder_dir(),
             threads=smk.threads)
    elif rule == "predict_sensitivity":
        from fedhisto.experiments.sensitivity_layout import reading_config

        warm("fedhisto.predict.stage:run_predict", smk.wildcards.method, int(smk.wildcards.seed),
             Path(smk.input.status).parent, smk.input.manifest, smk.input.identity, smk.input.descriptors,
             reading_config(cfg, smk.wildcards.reading), Path(smk.output.external).parent,
             encoder_dir=encoder_dir(), threads=smk.threads)
    elif rule == "predict_sensitivity_shifted":
        from fedhisto.experiments.sensitivity_layout import reading_config

        warm("fedhisto.experiments.shifted:predict_shifted", smk.wildcards.method, int(smk.wildcards.seed),
             Path(smk.input.status).parent, smk.input.manifest, smk.input.identity, smk.input.descriptors,
             smk.input.cohort, reading_config(cfg, smk.wildcards.reading), smk.output.predictions,
             encoder_dir=encoder_dir(), threads=smk.threads)
    elif rule == "summarize_sensitivity":
        warm("fedhisto.experiments.sensitivity:summarise_sensitivity", [tuple(r) for r in smk.params.runs],
             smk.input.cohort[0] if smk.input.cohort else None, cfg, Path(smk.output.json).parent)
    elif rule == "audit_privacy_condition":
        warm("fedhisto.experiments.privacy_audit:run_condition", cfg, smk.wildcards.audit, smk.input.manifest,
             smk.input.identity, smk.input.descriptors, smk.output.json,
             encoder_dir=encoder_dir(), threads=smk.threads)
    elif rule == "summarize_privacy_audit":
        warm("fedhisto.experiments.privacy_audit:summarise_privacy_audit", list(smk.input.audits), cfg,
             Path(smk.output.json).parent)
    else:
        raise SystemExit(f"scripts/experiments.py: no function for rule {rule!r}")
