# Using the model: export a method's finalised seeds as a portable package (results/export/{method}),
# then classify each folder listed under classify.folders (results/classify/{name}/). No training stage's
# identity reads the classify block, so listing a folder plans only these two jobs after `all`.

# checked here, not in the config model: experiments derive configs that train other method lists
if CFG.classify.folders and CFG.classify.method not in [m for m, _ in train_runs()]:
    raise ValueError(f"classify.method {CFG.classify.method!r} is not trained by this config "
                     f"(train.methods / train.ablations); classify exports one of those")


rule export_model:
    input:
        status=lambda wildcards: [f"results/train/{wildcards.method}/seed{s}/status.json"
                                  for s in method_seeds(wildcards.method)],
        predictions=lambda wildcards: [f"results/predictions/{wildcards.method}/seed{s}/{c}.csv"
                                       for s in method_seeds(wildcards.method) for c in ("test", "external")],
        identity="results/manifest/manifest.json",
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
        "../../scripts/classify.py"


rule classify_folder:
    input:
        package=f"results/export/{CFG.classify.method}",
        cohort=classify_cohort_input,
    output:
        predictions=report("results/classify/{name}/predictions.csv", caption="../report/classify_table.rst",
                           category="Classify", subcategory="{name}"),
        summary="results/classify/{name}/predictions.json",
        exclusions="results/classify/{name}/predictions.exclusions.csv",
        sheet=report("results/classify/{name}/contact_sheet.png", caption="../report/classify_sheet.rst",
                     category="Classify", subcategory="{name}"),
    wildcard_constraints:
        name="[^/]+",
    log:
        "logs/classify/{name}.log",
    params:
        images=classify_images,
        block=CFG.classify.model_dump(mode="json", exclude={"folders"}),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    script:
        "../../scripts/classify.py"
