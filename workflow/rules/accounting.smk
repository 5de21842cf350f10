# Stage accounting: parameters and communication per round, from real tensor shapes.


rule account_communication:
    output:
        csv="results/accounting/communication.csv",
    log:
        "logs/accounting/account_communication.log",
    params:
        model=CFG.model.model_dump(mode="json"),
        methods=CFG.train.methods + CFG.train.ablations,
        targets=CFG.partition_targets().model_dump(mode="json"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/accounting.py"
