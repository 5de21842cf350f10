# Stage accounting: parameters and communication per round, from real tensor shapes.


rule account_communication:
    output:
        csv="results/accounting/communication.csv",
    log:
        "logs/accounting/account_communication.log",
    params:
        block=stage_block(CFG, "accounting"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    script:
        "../../scripts/accounting.py"
