"""Stage experiments: results/experiments/<name>/ (designs in docs/experiments.md).

One entry script for the stage's rules; each rule calls one library function. Standalone:
``snakemake results/experiments/<name>/<name>.json`` (the experiments need the main pipeline's artifacts).
"""

from pathlib import Path

from fedhisto.entry import from_snakemake

if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    rule = smk.rule
    if rule == "render_shifted_cohort":
        from fedhisto.synth.severity import run_render_shift

        run_render_shift(cfg, Path(smk.output.cohort).parent, threads=smk.threads)
    elif rule == "pretrain_plain_encoder":
        from fedhisto.experiments.layout import plain_encoder_config
        from fedhisto.pretrain import run_pretrain

        run_pretrain(plain_encoder_config(cfg), smk.output.encoder, threads=smk.threads,
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
        from fedhisto.train.stage import run_train

        run_train(smk.wildcards.method, int(smk.wildcards.seed), smk.input.manifest, smk.input.identity,
                  smk.input.descriptors, condition_config(cfg, f"dose_response/{smk.wildcards.label}"),
                  Path(smk.output.status).parent, encoder_dir=None, threads=smk.threads)
    elif rule == "predict_shifted_cohort":
        from fedhisto.experiments.layout import condition_config
        from fedhisto.experiments.shifted import predict_shifted

        predict_shifted(smk.wildcards.method, int(smk.wildcards.seed), Path(smk.input.status).parent,
                        smk.input.manifest, smk.input.identity, smk.input.descriptors, smk.input.cohort,
                        condition_config(cfg, f"dose_response/{smk.wildcards.encoder}"),
                        smk.output.predictions, encoder_dir=smk.input.encoder[0] if smk.input.encoder else None,
                        threads=smk.threads)
    elif rule == "summarize_dose_response":
        from fedhisto.experiments.dose_response import summarise_dose_response

        summarise_dose_response([tuple(r) for r in smk.params.runs], smk.input.cohort, cfg,
                                Path(smk.output.json).parent)
    elif rule == "summarize_leakage":
        from fedhisto.experiments.leakage import summarise_leakage

        summarise_leakage([tuple(r) for r in smk.params.runs], dict(smk.params.manifests), cfg,
                          Path(smk.output.json).parent)
    elif rule == "summarize_leave_one_site_out":
        from fedhisto.experiments.leave_one_site_out import summarise_leave_one_site_out

        summarise_leave_one_site_out([tuple(r) for r in smk.params.runs], cfg, Path(smk.output.json).parent)
    elif rule == "calibrate_checkpoints":
        from fedhisto.experiments.calibration import summarise_calibration

        summarise_calibration([tuple(r) for r in smk.params.runs], cfg, Path(smk.output.json).parent)
    elif rule == "probe_encoder":
        from fedhisto.experiments.probe import probe_condition

        probe_condition(cfg, smk.wildcards.encoder, smk.input.cohort, Path(smk.output.json).parent,
                        encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, threads=smk.threads)
    elif rule == "summarize_probe":
        from fedhisto.experiments.probe import summarise_probe

        summarise_probe(dict(smk.params.probes), smk.input.dose_response, cfg, Path(smk.output.json).parent)
    elif rule == "train_sensitivity":
        from fedhisto.experiments.sensitivity_layout import reading_config
        from fedhisto.train.stage import run_train

        run_train(smk.wildcards.method, int(smk.wildcards.seed), smk.input.manifest, smk.input.identity,
                  smk.input.descriptors, reading_config(cfg, smk.wildcards.reading), Path(smk.output.status).parent,
                  encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, threads=smk.threads)
    elif rule == "predict_sensitivity":
        from fedhisto.experiments.sensitivity_layout import reading_config
        from fedhisto.predict import run_predict

        run_predict(smk.wildcards.method, int(smk.wildcards.seed), Path(smk.input.status).parent, smk.input.manifest,
                    smk.input.identity, smk.input.descriptors, reading_config(cfg, smk.wildcards.reading),
                    Path(smk.output.external).parent, encoder_dir=smk.input.encoder[0] if smk.input.encoder else None,
                    threads=smk.threads)
    elif rule == "predict_sensitivity_shifted":
        from fedhisto.experiments.sensitivity_layout import reading_config
        from fedhisto.experiments.shifted import predict_shifted

        predict_shifted(smk.wildcards.method, int(smk.wildcards.seed), Path(smk.input.status).parent,
                        smk.input.manifest, smk.input.identity, smk.input.descriptors, smk.input.cohort,
                        reading_config(cfg, smk.wildcards.reading), smk.output.predictions,
                        encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, threads=smk.threads)
    elif rule == "summarize_sensitivity":
        from fedhisto.experiments.sensitivity import summarise_sensitivity

        summarise_sensitivity([tuple(r) for r in smk.params.runs], smk.input.cohort[0] if smk.input.cohort else None,
                              cfg, Path(smk.output.json).parent)
    elif rule == "audit_privacy_condition":
        from fedhisto.experiments.privacy_audit import run_condition

        run_condition(cfg, smk.wildcards.audit, smk.input.manifest, smk.input.identity, smk.input.descriptors,
                      smk.output.json, encoder_dir=smk.input.encoder[0] if smk.input.encoder else None,
                      threads=smk.threads)
    elif rule == "summarize_privacy_audit":
        from fedhisto.experiments.privacy_audit import summarise_privacy_audit

        summarise_privacy_audit(list(smk.input.audits), cfg, Path(smk.output.json).parent)
    else:
        raise SystemExit(f"scripts/experiments.py: no function for rule {rule!r}")
