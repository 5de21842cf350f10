# Stage classify: each folder listed under classify.folders through the exported package of classify.method
# (results/classify/{name}/; the package is stage export's). No training stage's identity reads the classify
# block, so listing a folder plans only the export and classify jobs after `all`.

# checked here, not in the config model: experiments derive configs that train other method lists
if CFG.classify.folders and CFG.classify.method not in [m for m, _ in train_runs()]:
    raise ValueError(f"classify.method {CFG.classify.method!r} is not trained by this config "
                     f"(train.methods / train.ablations); classify exports one of those")


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
