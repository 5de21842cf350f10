"""The ground floor every stage stands on: atomic writes, provenance sidecars, code identity, progress,
processes, image I/O, figure files, job logging, the strict settings base and the warm stage server."""
