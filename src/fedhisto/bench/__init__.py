"""``fedhisto bench`` and the GPU check's summary: throughput of the PEFT model, sequential vs batched."""
