# Stage export: a method's finalised seeds as a portable package (results/export/{method}): adapters,
# heads and calibration in safetensors/JSON, a model card, checksums. `fedhisto export` does the same
# outside Snakemake; stage classify applies the package to new images.


rule export_model:
    input:
        status=lambda wildcards: [f"results/train/{wildcards.method}/seed{s}/status.json"
                                  for s in method_seeds(wildcards.method)],
        predictions=lambda wildcards: [f"results/predictions/{wildcards.method}/seed{s}/{c}.csv"
                                       for s in method_seeds(wildcards.method) for c in ("test", "external")],
        identity="results/manifest/manifest.json",
        manifest="results/manifest/manifest.csv",
        descriptors="results/stain/descriptors.json",
        encoder=encoder_input,
    output:
        package=directory("results/export/{method}"),
    log:
        "logs/export/{method}.log",
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=10,
        gpu=0,
    script:
        "../../scripts/export.py"
